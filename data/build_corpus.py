"""Build the embedded default corpus (the Python standard library) and its tokenizer.

    python data/build_corpus.py                      # build into the user cache, or reuse what is there
    python data/build_corpus.py --rebuild            # build from scratch
    python data/build_corpus.py --vocab-size 512     # a smaller tokenizer

Training and evaluation build both on first use; this prints what they hold. It writes
<cache>/stdlib/ (a save_to_disk DatasetDict plus meta.json) and
<cache>/tokenizer-stdlib-v<vocab>-s<seed>/ (<cache>: `selfspec.files.cache_dir`, or --out), then prints files,
characters and tokens per split. Both are what `data.source: stdlib` in the recipes loads. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from selfspec import data
from selfspec.files import cache_dir


def count_tokens(texts: list[str], tokenizer) -> int:
    """Tokens in texts, without the eos that packing adds after each document."""
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return sum(map(len, encoded))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(cache_dir()), help="cache dir (default: %(default)s)")
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="tokenizer vocabulary (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="split seed (default: %(default)s)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild even if the outputs exist")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    corpus, tokenizer = data.prepare_stdlib(args.out, args.vocab_size, args.seed, rebuild=args.rebuild)
    built_s = time.perf_counter() - start

    print(f"corpus:    {Path(args.out) / 'stdlib'}")
    print(
        f"tokenizer: {data.stdlib_tokenizer_dir(args.out, args.vocab_size, args.seed)} "
        f"({len(tokenizer)} tokens, eos id {tokenizer.eos_token_id})"
    )
    print(f"{'split':<11}{'files':>7}{'characters':>13}{'tokens':>11}{'chars/token':>13}")
    for name, split in corpus.items():
        texts = split["text"][:]
        chars, tokens = sum(map(len, texts)), count_tokens(texts, tokenizer)
        print(f"{name:<11}{len(split):>7}{chars:>13,}{tokens:>11,}{chars / tokens:>13.2f}")
    print(f"built or loaded in {built_s:.1f} s; counted in {time.perf_counter() - start - built_s:.1f} s")


if __name__ == "__main__":
    main()
