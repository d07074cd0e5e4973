"""Old code against new, interleaved on one machine: `tools/engine_ab.py` run under each tree in turn.

    git archive OLD | tar -x -C /tmp/old
    python tools/tree_ab.py --trees /tmp/old . --model runs/demo/model --cells plain,stored --repeats 5
    python tools/tree_ab.py --trees /tmp/old . --models OLD_MODEL NEW_MODEL ...   # a checkpoint each

Each repeat runs every tree once, in turn (each run its own process: a warm-up, then the timed cells),
the order rotated from repeat to repeat, so a slow minute of the machine, or a tree's place in the
turn, falls on both. Prints each cell's median tokens/s per tree, the last
tree over the first (the median of the repeats' paired ratios, with the lowest and highest), and each
tree's cells over its own `plain` when it ran. Run it with the machine to itself. Each tree builds its
kernels once, in a folder of its own (`TORCH_EXTENSIONS_DIR`), before the first timed repeat.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("engine_ab.py")


def run(tree: str, model: str | None, args: argparse.Namespace) -> dict:
    """One `engine_ab.py` run under `tree`'s package on `model`: {cell: tokens/s}."""
    env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()),
               TORCH_EXTENSIONS_DIR=str(Path(args.extensions) / Path(tree).resolve().name))
    command = [sys.executable, str(SCRIPT), "--cells", args.cells, "--prompts", str(args.prompts),
               "--new-tokens", str(args.new_tokens)] + (["--model", model] if model else [])
    command += ["--context", str(args.context)] if args.context else []
    command += ["--seeds", str(args.seeds)] if args.seeds > 1 else []
    command += ["--decode-only"] if args.decode_only else []
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", required=True, help="package roots, the old first")
    parser.add_argument("--model", default=None)
    parser.add_argument("--models", nargs="+", default=None,
                        help="a checkpoint per tree, in --trees' order (old code on the old checkpoint)")
    parser.add_argument("--cells", default="plain,stored")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=None,
                        help="prompts of this many tokens (engine_ab.py)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="draws per prompt of a sampled cell (engine_ab.py)")
    parser.add_argument("--decode-only", action="store_true", help="rates over decode time (engine_ab.py)")
    parser.add_argument("--extensions", default="/tmp/tree_ab_extensions")
    args = parser.parse_args()
    if args.models and args.model:
        parser.error("give --model (one checkpoint for every tree) or --models (one a tree), not both")
    if args.models and len(args.models) != len(args.trees):
        parser.error(f"--models names {len(args.models)} checkpoints for {len(args.trees)} trees; "
                     "give one a tree")
    models = args.models or [args.model] * len(args.trees)
    arms = list(zip(args.trees, models))  # a tree may run twice, on two checkpoints
    warm = argparse.Namespace(**{**vars(args), "prompts": 1, "new_tokens": 8})
    for tree, model in arms:  # builds the kernels and warms the file cache: not timed
        run(tree, model, warm)
    runs = [[] for _ in arms]  # runs[i]: arm i's repeats
    order = list(range(len(arms)))
    for repeat in range(args.repeats):  # the order rotates: no tree always runs first (or last)
        shift = repeat % len(arms)
        for i in order[shift:] + order[:shift]:
            runs[i].append(run(*arms[i], args))
    names = [tree if not args.models else f"{tree} on {model}" for tree, model in arms]
    cells = args.cells.split(",")
    context = f", {args.context}-token prompts, decode time only" if args.context else ""
    context += f", sampled cells {args.seeds} draws a prompt" if args.seeds > 1 else ""
    context += ", decode time only" if args.decode_only and not args.context else ""
    checkpoints = " / ".join(dict.fromkeys(m or "random Llama" for m in models))
    print(f"{checkpoints}: {args.prompts} prompts x {args.new_tokens} tokens{context}, "
          f"median of {args.repeats} interleaved repeats")
    print("| cell | " + " | ".join(f"{n} tok/s" for n in names)
          + f" | {names[-1]} / {names[0]} (low-high) |"
          + ("".join(f" {n} x plain |" for n in names) if "plain" in cells else ""))
    print("|---|" + "---:|" * (len(arms) + 1 + (len(arms) if "plain" in cells else 0)))
    for cell in cells:
        medians = [statistics.median(r[cell] for r in arm_runs) for arm_runs in runs]
        ratios = [b[cell] / a[cell] for a, b in zip(runs[0], runs[-1])]
        row = f"| {cell} | " + " | ".join(f"{m:.1f}" for m in medians)
        row += f" | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        if "plain" in cells:
            row += "".join(f" {statistics.median(r[cell] / r['plain'] for r in arm_runs):.3f} |"
                           for arm_runs in runs)
        print(row)


if __name__ == "__main__":
    main()
