"""A/B of the compiled greedy rounds against the round run from Python, side by side.

    python tools/round_ab.py --model runs/demo/model --exit-layer 6 --ks 2,3,4 --repeats 5
    python tools/round_ab.py --model runs/smollm2/base --exit-layer 10 --ks 3 --prompts json-extract
    python tools/round_ab.py --model runs/demo/model --ks 4 --batch-size 4 --ragged --python-level blocks
    python tools/round_ab.py --model runs/smollm2/base --exit-layer 10 --ks "" --drafters ngram,hybrid

Decodes the same prompts (batch 1, greedy) with plain decoding and the early exit at each k, each in
three arms: `python` (`selfspec.model.fast.kernels_up_to("passes")`: the draft steps and the
verification from Python, the operations one by one), `rounds` (the draft loop and the verification in
one kernel call each) and `decode` (a call's rounds of one row in one kernel call, `greedy_rounds`;
a batch runs as `rounds` until one row is left), interleaved over repeats after a warm-up. Prints each
decode's tokens/s (median), its speedup over plain decoding in the same arm (the median of paired
ratios and its interval), the one-call arm over the per-round arm, and the round profile of every
decode (`evaluation.rounds`).
Outputs must be identical across arms and methods (checked). Run it with the machine to itself.
`--batch-size` decodes the prompts in batches; `--ragged` cuts the i-th prompt of a batch by 7·i
tokens, so the rows sit at different slots; `--python-level blocks` makes the Python arm run block by
block (what rows at different slots ran before the compiled calls took them).
"""

from __future__ import annotations

import argparse
import statistics

from selfspec.checkpoint import checkpoint_adapters, resolve_settings
from selfspec.decoding import SelfSpecGenerator
from selfspec.evaluation.paired import median_interval, paired_speedups
from selfspec.evaluation.prompts import Structured, read_prompts
from selfspec.evaluation.rounds import round_profile, to_markdown
from selfspec.evaluation.timing import constraint_keywords, interleaved_rates, load_model
from selfspec.model import fast

# the arms: the round from Python (`--python-level`), each round as compiled calls, a call's rounds in one
ARMS = ("python", "rounds", "decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--exit-layer", type=int, default=None, help="E (default: the checkpoint's)")
    parser.add_argument("--ks", default="3", help="comma list of k (\"\": none)")
    parser.add_argument("--drafters", default="", help="comma list of drafters besides the early exit "
                        "(ngram, hybrid: at the checkpoint's settings otherwise)")
    parser.add_argument("--prompts", default=None, help="a prompt file or json-extract (default: the corpus)")
    parser.add_argument("--corpus", default="stdlib")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--ragged", action="store_true", help="rows of a batch at different slots")
    parser.add_argument("--python-level", default="passes", choices=["passes", "blocks"],
                        help="the compiled paths the Python arm keeps (fast.kernels_up_to)")
    args = parser.parse_args()

    settings, _, counts = resolve_settings(args.model, exit_layer=args.exit_layer)
    lm, tokenizer = load_model(args.model)
    generator = SelfSpecGenerator(lm, tokenizer, settings, token_counts=counts,
                                  exit_adapters=checkpoint_adapters(args.model, lm))
    generator.check_cache = False  # a timed run does no per-round bookkeeping
    prompts = read_prompts(tokenizer, args.prompts, args.corpus, args.num_prompts)
    cells = {"plain": settings.override(drafter="early_exit", num_speculations=0)}
    cells.update({f"k={k}": settings.override(drafter="early_exit", num_speculations=int(k))
                  for k in args.ks.split(",") if k})
    cells.update({drafter: settings.override(drafter=drafter)
                  for drafter in args.drafters.split(",") if drafter})
    names = [(arm, cell) for cell in cells for arm in ARMS]

    def run(name, batch):
        arm, cell = name
        constraints = [p.constraint if isinstance(p, Structured) else None for p in batch]
        with fast.kernels_up_to(args.python_level if arm == "python" else arm):
            out = generator.generate([p.ids if isinstance(p, Structured) else p for p in batch],
                                     max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                     settings=cells[cell], profile=True, **constraint_keywords(constraints))
        return out.sequences, out.stats

    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    if args.ragged:  # row i of a batch 7·i tokens shorter: every row at its own slots
        batches = [[p[:max(1, len(p) - 7 * i)] for i, p in enumerate(batch)] for batch in batches]
    timings = interleaved_rates(names, run, batches, args.repeats, 1, generator.view.device, "round A/B")
    reference = timings.outputs[("python", "plain")]
    print(f"{args.model}: E = {settings.exit_layer}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats} interleaved repeats; outputs identical across arms and methods: "
          f"{all(out == reference for out in timings.outputs.values())}\n")
    print("| decode | " + " | ".join(f"{arm} tok/s" for arm in ARMS) + " | one call / per round | "
          + " | ".join(f"{arm} × plain" for arm in ARMS) + " |")
    print("|---|" + "---:|" * (2 * len(ARMS) + 1))
    for cell in cells:
        rates = {arm: timings.rates((arm, cell)) for arm in ARMS}
        over = median_interval(paired_speedups(rates["decode"], rates["rounds"]))
        plain = {arm: median_interval(paired_speedups(rates[arm], timings.rates((arm, "plain"))))
                 for arm in rates}
        print(f"| {cell} | " + " | ".join(f"{statistics.median(rates[arm]):.1f}" for arm in ARMS) + " | "
              f"{over['speedup']:.3f} ({over['low']:.3f}-{over['high']:.3f}) | "
              + " | ".join(f"{plain[arm]['speedup']:.3f} ({plain[arm]['low']:.3f}-{plain[arm]['high']:.3f})"
                           for arm in rates) + " |")
    for arm in ARMS:
        profile = round_profile({("plain" if cell == "plain" else cell): timings.run_stats((arm, cell))
                                 for cell in cells})
        print(f"\n{arm}: " + to_markdown(profile))

if __name__ == "__main__":
    main()
