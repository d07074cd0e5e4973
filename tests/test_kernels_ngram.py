"""The compiled rounds' copies propose what the Python proposer proposes.

`greedy_rounds` (selfspec/backends/cpu_rounds/rounds.cpp) copies with `NGramSearch`: the row's history,
extended with the kept tokens of every round, searched from its end for the latest earlier occurrence of
its longest suffix, after the sequence alone or, for the hybrid, after the sequence and the early exit's
drafts (`extra`).
The extension exposes that same struct (`round_kernels.ngram_search()`), and these tests hold it to
`ngram.NGramIndex(tokens, NGramConfig(...)).propose(limit, extra)` over random, periodic and
phrase-repeating histories, several min/max n, limits and extras, built at once and extended piece by
piece.

Covered: each n-gram's latest earlier occurrence, the longest suffix of
min_ngram..max_ngram tokens, the copy around the period when the match runs into the end, the limit,
and `extra`. Not covered: `NGramIndex`'s text matches (`TokenText`), which only constrained decoding
makes and which the C++ does not have (the compiled rounds run without a grammar); the limit and n
that `CopyPolicy` and `FusedDrafts` pass in; and what greedy_rounds does with a proposal, which
tests/test_decoding_draft_loop.py and tests/test_backends.py hold to the Python rounds.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import kernels_unavailable

import selfspec.backends.cpu_rounds as round_kernels
from selfspec.decoding.ngram import NGramConfig, NGramIndex

CONFIGS = [(1, 1), (1, 3), (2, 2), (2, 3), (2, 5), (4, 6)]  # (min_ngram, max_ngram)
LIMITS = (0, 1, 3, 10, 25)


@pytest.fixture(scope="module")
def tables():
    made = round_kernels.ngram_search()
    if made is None:
        kernels_unavailable()
    return made


def _history(rng: np.random.Generator, kind: str) -> list[int]:
    length = int(rng.integers(0, 160))
    if kind == "random":  # a small vocabulary repeats short n-grams by chance
        return rng.integers(0, int(rng.integers(2, 40)), length).tolist()
    if kind == "periodic":  # a unit repeated, a few tokens changed
        unit = rng.integers(0, 50_000, int(rng.integers(1, 9)))
        tokens = np.resize(unit, length)
        tokens[rng.integers(0, max(length, 1), int(rng.integers(0, 4)))[:length]] = rng.integers(0, 50_000)
        return tokens.tolist()
    phrases = [rng.integers(0, 300, int(rng.integers(2, 11))).tolist() for _ in range(5)]
    tokens = []
    while len(tokens) < length:  # phrases from a small bank among random fillers
        tokens += phrases[int(rng.integers(0, 5))] if rng.random() < 0.7 else rng.integers(0, 300, 3).tolist()
    return tokens[:length]


def _extra(rng: np.random.Generator, history: list[int]) -> list[int]:
    """Drafts after the sequence: none, random ones, or the tokens that followed some earlier position."""
    count = int(rng.integers(0, 7))
    if history and rng.random() < 0.6:
        first = int(rng.integers(0, len(history)))
        return history[first:first + count]
    return rng.integers(0, 300, count).tolist()


@pytest.mark.parametrize(("min_ngram", "max_ngram"), CONFIGS)
@pytest.mark.parametrize("kind", ["random", "periodic", "phrases"])
@pytest.mark.parametrize("seed", range(16))
def test_the_compiled_copies_propose_what_ngram_index_proposes(tables, seed, kind, min_ngram, max_ngram):
    rng = np.random.default_rng([seed, min_ngram, max_ngram, len(kind)])
    config = NGramConfig(max_ngram=max_ngram, min_ngram=min_ngram)
    history = _history(rng, kind)
    compiled, python = tables(history, min_ngram, max_ngram), NGramIndex(history, config)
    proposed = 0
    for extra in ([], *(_extra(rng, history) for _ in range(4))):
        for limit in LIMITS:
            expected = python.propose(limit, extra)[0]
            assert compiled.propose(limit, extra) == expected, (history, extra, limit)
            proposed += bool(expected)
    # extended piece by piece, as the rounds extend them with each round's kept tokens
    cut = int(rng.integers(0, len(history) + 1))
    compiled, python = tables(history[:cut], min_ngram, max_ngram), NGramIndex(history[:cut], config)
    while cut < len(history):
        piece = history[cut:cut + int(rng.integers(1, 6))]
        cut += len(piece)
        compiled.extend(piece)
        python.extend(piece)
        extra, limit = _extra(rng, history[:cut]), int(rng.choice(LIMITS))
        expected = python.propose(limit, extra)[0]
        assert compiled.propose(limit, extra) == expected, (history[:cut], extra, limit)
        alone = python.propose(limit)[0]
        assert compiled.propose(limit) == alone, (history[:cut], limit)
        proposed += bool(expected) + bool(alone)
    if kind == "periodic" and len(history) > 4 * max_ngram + 20:
        assert proposed, history  # a repeated unit matches: the lookups found copies, not only none


def test_the_compiled_copies_continue_around_the_period(tables):
    """A match so recent that what followed it runs into the end copies on around the period, as
    `NGramIndex.propose` does (known values, not only equality with it)."""
    compiled = tables([1, 2, 3, 1, 2, 3, 1, 2], 2, 3)
    assert compiled.propose(7) == [3, 1, 2, 3, 1, 2, 3]
    assert compiled.propose(4, [9]) == []  # no suffix ending in 9 occurred
    assert compiled.propose(3, [3, 1]) == [2, 3, 1]
    assert tables([5, 6, 7], 2, 3).propose(5) == []  # nothing repeats
