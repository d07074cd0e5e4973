"""Write held-out chat prompts (first user turns) as .jsonl prompt files for `selfspec generate --prompts`.

    python data/chat_prompts.py --out runs/prompts --per-category 2
    selfspec generate runs/smollm2/chat_ld/model --chat --prompts runs/prompts/mtbench.jsonl \
        --drafter early_exit --num-speculations 3 --max-new-tokens 128 --no-eos

mtbench.jsonl: the first turns of MT-bench (2 per category: 16); sharegpt_heldout.jsonl: the first
16 held-out ShareGPT conversations' first turns. The stats line gives the early exit's α on the
model's own greedy replies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.data.questions import first_turns, heldout_questions, mtbench_file, read_questions
from selfspec.files import write_text_atomic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/prompts")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--sharegpt", type=int, default=16, help="held-out ShareGPT prompts to write")
    args = parser.parse_args()
    suites = {"mtbench": first_turns(read_questions(mtbench_file()), args.per_category),
              "sharegpt_heldout": heldout_questions()[:args.sharegpt]}
    for name, questions in suites.items():
        path = write_text_atomic(Path(args.out) / f"{name}.jsonl",
                                 "".join(json.dumps({"prompt": q["turns"][0]}) + "\n" for q in questions))
        print(f"{path}: {len(questions)} prompts")


if __name__ == "__main__":
    main()
