"""selfspec's server side by side with llama.cpp's OpenAI server on the same model, at the same precision.

    python tools/llamacpp_compare.py --model runs/smollm2/json/model --gguf /tmp/smollm2-f32.gguf \\
        --llama-python /tmp/lcpvenv/bin/python --requests 8 --max-tokens 128

`--gguf` is the same weights as `--model` for llama.cpp (for an imported model, convert its directory
with llama.cpp's own `convert_hf_to_gguf.py --outtype f32`); `--llama-python` a Python with
`llama-cpp-python[server]` installed. Both servers run on this machine: selfspec's in this process at
the checkpoint's stored settings (`--drafter none`: plain decoding), llama.cpp's as a subprocess with
as many threads as torch uses. The same chat requests go to each, one client, one request at a time,
the servers alternating request by request after one warm-up request each, greedy. With
`--prompts json-extract` (the default) each request carries its prompt's JSON schema as
`response_format`, which both servers enforce with their own grammar engines (llama.cpp's allows
spaces inside the JSON where selfspec's writes it compact, so the replies differ in form);
`--prompts chat` sends the extraction prompts as free chat. Prints each server's tokens/s (completion
tokens over wall time, all requests), the median of the per-request ratios with its interval, and how
many replies are identical.
Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import httpx
import torch

from selfspec.checkpoint import load_tuned
from selfspec.data.extraction import extraction_prompts
from selfspec.evaluation.paired import median_interval
from selfspec.evaluation.serve_load import _free_port
from selfspec.serving.app import create_app, run_in_thread


def _chat(client: httpx.Client, url: str, message: str, schema: dict | None, max_tokens: int,
          llama: bool = False) -> tuple:
    """One greedy chat completion: (text, completion tokens, seconds). llama: llama-cpp-python's server,
    which takes a schema as `{"type": "json_object", "schema": ...}` (its own form of response_format)."""
    body = {"model": "served", "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
            "temperature": 0}
    if schema is not None:
        named = {"name": "record", "schema": schema}
        body["response_format"] = ({"type": "json_object", "schema": schema} if llama
                                   else {"type": "json_schema", "json_schema": named})
    start = time.perf_counter()
    response = client.post(f"{url}/chat/completions", json=body)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    reply = response.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], seconds


def _start_llama(python: str, gguf: str, port: int, threads: int, context: int) -> subprocess.Popen:
    process = subprocess.Popen([python, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                                "--n_threads", str(threads), "--n_threads_batch", str(threads),
                                "--n_ctx", str(context), "--verbose", "False"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"llama.cpp's server exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise SystemExit("llama.cpp's server did not start in 5 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a selfspec checkpoint or model directory")
    parser.add_argument("--gguf", required=True, help="the same weights as a GGUF file for llama.cpp")
    parser.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python[server]")
    parser.add_argument("--prompts", default="json-extract", choices=["json-extract", "chat"])
    parser.add_argument("--requests", type=int, default=8, help="requests per server (held-out prompts)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--drafter", default=None, help="override the stored drafter (none: plain decoding)")
    args = parser.parse_args()

    overrides = {"num_speculations": 0} if args.drafter == "none" else (
        {"drafter": args.drafter} if args.drafter else {})
    gen = load_tuned(args.model, **overrides)
    tasks = extraction_prompts("test", per_category=max(1, -(-args.requests // 4)))[:args.requests]
    port, llama_port = _free_port(), _free_port()
    server = run_in_thread(create_app(gen, "served"), port)
    llama = _start_llama(args.llama_python, args.gguf, llama_port, torch.get_num_threads(), 2048)
    urls = {"selfspec": f"http://127.0.0.1:{port}/v1", "llama.cpp": f"http://127.0.0.1:{llama_port}/v1"}
    results = {name: [] for name in urls}
    schemas = [task.schema if args.prompts == "json-extract" else None for task in tasks]
    try:
        with httpx.Client(timeout=600) as client:
            for name, url in urls.items():  # warm-up: kernels, grammar engines
                _chat(client, url, tasks[0].message, schemas[0], args.max_tokens, name == "llama.cpp")
            for index, task in enumerate(tasks):
                order = list(urls) if index % 2 == 0 else list(urls)[::-1]
                for name in order:
                    reply = _chat(client, urls[name], task.message, schemas[index], args.max_tokens,
                                  name == "llama.cpp")
                    results[name].append(reply)
    finally:
        server.should_exit = True
        llama.terminate()
        llama.wait(timeout=30)
    print(f"{args.model} at {gen.settings.describe()} against llama.cpp on {args.gguf}; {len(tasks)} "
          f"{args.prompts} requests of up to {args.max_tokens} tokens, one client, greedy, alternating\n")
    print("| server | tokens/s | completion tokens | seconds |")
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        tokens, seconds = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"| {name} | {tokens / seconds:.1f} | {tokens} | {seconds:.1f} |")
    pairs = list(zip(results["selfspec"], results["llama.cpp"]))
    interval = median_interval([(ours[1] / ours[2]) / (theirs[1] / theirs[2]) for ours, theirs in pairs])
    same = sum(ours[0] == theirs[0] for ours, theirs in pairs)
    print(f"\nselfspec ÷ llama.cpp, per request: median {interval['speedup']:.2f}× "
          f"({interval['low']:.2f}-{interval['high']:.2f}); replies identical: {same}/{len(tasks)}; "
          f"mean reply {statistics.mean(r[1] for r in results['selfspec']):.0f} tokens")


if __name__ == "__main__":
    main()
