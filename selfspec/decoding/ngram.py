"""Drafts copied from the context: n-gram lookup over the prompt and the text generated so far.

Prompt lookup (Saxena 2023; Hugging Face's `prompt_lookup_num_tokens`): when the last n tokens
already occurred earlier in the sequence, the tokens that followed them there are a good guess for
what follows now. Code, extraction and editing repeat their context a lot, and such a draft costs
no model call at all. Its draft is a deterministic function of the context, so in sampling mode
its q is one-hot (see `sampling.accept_sampled`: accept with probability p(x), on rejection draw
from p with x removed).

`NGramIndex` keeps, per n in [min_ngram, max_ngram], a hash table from every n-gram of the
sequence that has a following token to the position after its most recent occurrence. Appending a
token indexes the n-grams that end just before it, so a lookup is one dictionary probe per n and
the sequence is never rescanned (Hugging Face's candidate generator rescans it every step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class NGramConfig:
    """How copies are found and how long they may be.

    max_ngram/min_ngram: the suffix lengths tried, longest first; a match shorter than `min_ngram`
        is no match (the threshold that decides between copying and early-exit drafting).
    max_copy: the most tokens one round copies (the copy controller adapts below it).
    """

    max_ngram: int = 3
    min_ngram: int = 2
    max_copy: int = 10

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise UserError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                             f"max_ngram={self.max_ngram}")
        if self.max_copy < 1:
            raise UserError(f"max_copy must be >= 1, got {self.max_copy}")

    @classmethod
    def from_dict(cls, fields: dict | None) -> NGramConfig:
        """From `selfspec.json`'s "ngram" entry (unknown keys are an error, missing ones default)."""
        fields = dict(fields or {})
        unknown = set(fields) - {"max_ngram", "min_ngram", "max_copy"}
        if unknown:
            raise UserError(f"unknown n-gram settings {sorted(unknown)}; use max_ngram, min_ngram, max_copy")
        return cls(**{name: int(value) for name, value in fields.items()})

    def as_dict(self) -> dict:
        return {"max_ngram": self.max_ngram, "min_ngram": self.min_ngram, "max_copy": self.max_copy}


class NGramIndex:
    """The token sequence of one row and its n-gram tables (see the module docstring)."""

    def __init__(self, tokens, config: NGramConfig):
        self.config = config
        self.tokens: list[int] = []
        # n -> {n-gram: position of the token after its latest occurrence}
        self.tables: dict[int, dict[tuple, int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; index every n-gram that now has a following token."""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        seq = self.tokens
        for follow in range(max(start, 1), len(seq)):  # the n-grams ending just before `follow`
            for n, table in self.tables.items():
                if follow >= n:
                    table[tuple(seq[follow - n:follow])] = follow

    def propose(self, limit: int, extra=()) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest matching suffix, and that suffix's length n.

        extra: tokens drafted after the sequence but not yet accepted; the suffix is taken from the
        sequence followed by them (the matches themselves come from the sequence). ([], 0) when no
        suffix of length >= min_ngram occurred before.

        When the latest occurrence is so recent that what followed it runs into the end, the text is
        repeating with period P = (length − that position) and the copy continues around the
        period: what copying again after the copied tokens would propose, in one round instead of
        several.
        """
        extra = [int(t) for t in extra]
        seq = self.tokens + extra if extra else self.tokens
        for n in range(min(self.config.max_ngram, len(seq) - 1), self.config.min_ngram - 1, -1):
            follow = self.tables[n].get(tuple(seq[len(seq) - n:]))
            if follow is not None:
                period = len(seq) - follow
                return [seq[follow + i % period] for i in range(limit)], n
        return [], 0
