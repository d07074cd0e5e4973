"""Drafts copied from the context: n-gram lookup over the prompt and the text generated so far.

Prompt lookup (Saxena 2023; Hugging Face's `prompt_lookup_num_tokens`): when the last n tokens
already occurred earlier in the sequence, the tokens that followed them there are a good guess for
what follows now. Code, extraction and editing repeat their context a lot, and such a draft costs
no model call at all. Its draft is a deterministic function of the context, so in sampling mode
its q is one-hot (see `sampling.accept_sampled`: accept with probability p(x), on rejection draw
from p with x removed).

`NGramIndex` keeps, per n in [min_ngram, max_ngram], a hash table from every n-gram of the
sequence that has a following token to the position after its most recent occurrence. A lookup
first indexes the n-grams ending before the tokens appended since the last one, so it is one
dictionary probe per n and the sequence is never rescanned (Hugging Face's candidate generator
rescans it every step).

Copies matched on the text (`TokenText`, given to the index): a reply often spells what it copies
with other tokens than the context. JSON puts a value after a quote where the prompt had it after a
space: the prompt's ` Charles| Dixon` becomes `"|Charles| Dixon`, and no token n-gram ends in
`Charles`; its ` Mccoyhaven` becomes `M|cc|oy|haven`. Where no token n-gram matches, the index looks
for the longest end of the sequence's text (at least `MIN_TEXT` characters and the whole last token)
earlier in it, and proposes what followed it there: the rest of the token the match ends in (when
the vocabulary has that piece), then the context's own tokens.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

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


MIN_TEXT = 2  # the shortest text match that copies (characters of the vocabulary's pieces)
TEXT_TAIL = 8  # the last tokens whose text a text match may end with
CLAUSE_ENDS = (",", ".", ";")
SPACES = ("Ġ", "▁", "Ċ", " ", "\n")  # a piece's first character that is a space or a line break
# what ends a value: a string's closing quote with what follows it, the quote alone, then a number's end
CLOSERS = ('",', '"}', '"', ",", "}")


class TokenText:
    """The vocabulary's pieces as text: each token id's string (byte-level or SentencePiece pieces,
    as `convert_ids_to_tokens` gives them: one spelling of every byte, so text matches text) and
    the id of each piece."""

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.pieces = [""] * (max(vocab.values()) + 1)
        for piece, token in vocab.items():
            self.pieces[token] = piece
        self.ids = vocab

    def piece(self, token: int) -> str:
        return self.pieces[token] if 0 <= token < len(self.pieces) else ""

    @functools.cached_property
    def closers(self) -> list[int]:
        """The tokens that may close a value a copy ended (`CLOSERS` that the vocabulary has), in order."""
        return [self.ids[piece] for piece in CLOSERS if piece in self.ids]

    def clause_end(self, copy: np.ndarray) -> int | None:
        """Where the context's clause ends in a copy (B, r): the first position i >= 1 (over the rows) of
        a `,`, `.` or `;` followed by a space or a line break; None where no row has one."""
        ends = [i for row in copy.tolist() for i in range(1, len(row) - 1)
                if self.piece(row[i]) in CLAUSE_ENDS and self.piece(row[i + 1])[:1] in SPACES]
        return min(ends) if ends else None


class NGramIndex:
    """The token sequence of one row and its n-gram tables (see the module docstring); with `text`, a
    `TokenText`, also the sequence's text and where each token starts in it."""

    def __init__(self, tokens, config: NGramConfig, text: TokenText | None = None):
        self.config = config
        self.tokens: list[int] = []
        # n -> {n-gram: position of the token after its latest occurrence}
        self.tables: dict[int, dict[tuple, int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self.indexed = 0  # the tables hold the n-grams whose following token lies below this position
        self.array = np.zeros(0, dtype=np.int64)  # `history`'s copy of the tokens so far
        self.text = text
        self.chars, self.starts = [], []  # the pieces so far, each token's first character
        self.length, self.joined = 0, None  # the text's length, and the text itself once asked for
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens. Their n-grams are indexed when a proposal first needs them (`propose`): a row
        whose copies the compiled rounds search (`NGramSearch`, from the sequence's end) never asks, and
        indexing a long prompt in Python cost milliseconds before its first token."""
        start = len(self.tokens)
        self.tokens.extend(tokens.tolist() if isinstance(tokens, np.ndarray) else (int(t) for t in tokens))
        if self.text is not None:
            for token in self.tokens[start:]:
                piece = self.text.piece(token)
                self.starts.append(self.length)
                self.chars.append(piece)
                self.length += len(piece)
            self.joined = None

    def history(self) -> np.ndarray:
        """(t,) the tokens so far as an array, grown by the tokens added since the last call (not made
        again from the whole list each compiled call). Shared: read it, do not write to it."""
        if len(self.array) < len(self.tokens):
            self.array = np.concatenate([self.array, np.array(self.tokens[len(self.array):], dtype=np.int64)])
        return self.array

    def _index(self) -> None:
        """Index every n-gram that has a following token and is not indexed yet."""
        seq = self.tokens
        for follow in range(max(self.indexed, 1), len(seq)):  # the n-grams ending just before `follow`
            for n, table in self.tables.items():
                if follow >= n:
                    table[tuple(seq[follow - n:follow])] = follow
        self.indexed = len(seq)

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
        if self.indexed < len(self.tokens):
            self._index()
        extra = [int(t) for t in extra]
        seq = self.tokens + extra if extra else self.tokens
        for n in range(min(self.config.max_ngram, len(seq) - 1), self.config.min_ngram - 1, -1):
            follow = self.tables[n].get(tuple(seq[len(seq) - n:]))
            if follow is not None:
                period = len(seq) - follow
                return [seq[follow + i % period] for i in range(limit)], n
        if self.text is not None and limit > 0:
            return self._text_copy(seq, limit), 0
        return [], 0

    def _text_copy(self, seq: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest end of `seq`'s text found earlier in the
        sequence's own text (see the module docstring); [] when none is."""
        if self.joined is None:
            self.joined = "".join(self.chars)
        text, pieces = self.joined, self.text
        tail = "".join(pieces.piece(t) for t in seq[-TEXT_TAIL:])
        shortest = max(MIN_TEXT, len(pieces.piece(seq[-1])))
        for size in range(len(tail), shortest - 1, -1):
            found = text.rfind(tail[-size:], 0, len(text) - 1)  # with at least one character after it
            if found < 0:
                continue
            after = found + size
            token = bisect.bisect_right(self.starts, after) - 1  # the token whose text holds `after`
            if after == self.starts[token]:  # the match ends where a token starts
                return self.tokens[token:token + limit]
            first = pieces.ids.get(self.chars[token][after - self.starts[token]:])
            if first is None:  # the rest of that token is no piece of the vocabulary
                return []
            return ([first] + self.tokens[token + 1:token + limit])[:limit]
        return []


class RowIndexes:
    """Every row's `NGramIndex` in one decode call, by the caller's row index: where a call's copies come
    from. `add` the rows' prompts in row order, `extend` them with what they emit; `copies` gives the
    running rows' copies as one draft."""

    def __init__(self, config: NGramConfig, text: TokenText | None = None):
        self.config, self.text = config, text
        self.indexes: list[NGramIndex] = []

    def add(self, prompts: list[list[int]]) -> None:
        """Rows with these prompts join, after the rows so far."""
        self.indexes += [NGramIndex(p, self.config, self.text) for p in prompts]

    def extend(self, rows: np.ndarray, tokens: np.ndarray, emit: np.ndarray) -> None:
        """Row rows[s] emitted tokens[s, :emit[s]]."""
        for slot, row in enumerate(rows):
            self.indexes[row].extend(tokens[slot, :emit[slot]])

    def history(self, row: int) -> np.ndarray:
        """(t,) the row's tokens so far, the pending token last (`NGramIndex.history`: shared, read only)."""
        return self.indexes[row].history()

    def copies(self, rows: np.ndarray, limit: int, extra: np.ndarray | None = None) -> np.ndarray:
        """The copies (B, r) of the rows `rows` (batch order), up to `limit` tokens each, after the drafts
        `extra` (B, j) where given (`NGramIndex.propose`), r the longest; rows with a shorter one (or
        none) fill up with their last token: any deterministic draft is lossless (one-hot q), a filler
        just tends to be rejected. (B, 0) when no row has a match."""
        proposals = [self.indexes[row].propose(limit, () if extra is None else extra[slot])[0]
                     for slot, row in enumerate(rows)]
        r = max(len(p) for p in proposals)
        if r == 0:
            return np.zeros((len(rows), 0), dtype=np.int64)
        last = [self.indexes[row].tokens[-1] if extra is None or not len(extra[slot]) else extra[slot][-1]
                for slot, row in enumerate(rows)]
        return np.array([p + [p[-1] if p else end] * (r - len(p)) for p, end in zip(proposals, last)],
                        dtype=np.int64)


__all__ = ["NGramConfig", "NGramIndex", "RowIndexes", "TokenText"]
