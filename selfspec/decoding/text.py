"""A row's text as its tokens come (`RowText`), ended by stop strings as OpenAI's API ends it.

A stop string ends its row at the token that completes it. The row's tokens keep that token (the ids are
what the model emitted, as with Hugging Face's `stop_strings` and vLLM); its text ends before the stop
string (OpenAI's `stop`: the returned text does not contain it). While the row runs, what may be shown
(`RowText.text`) leaves out the end of the text that a stop string could still claim and a character whose
bytes are not all there yet (a tokenizer decodes the part it has as U+FFFD), so that a stream never
sends what the final text takes back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BROKEN = "\ufffd"  # what a tokenizer decodes a character's incomplete bytes to


def text_of(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer`'s decoding of token ids to text, special tokens left out (what a reply shows)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class RowText:
    """One row's text (module docstring). decode: token ids -> text (special tokens left out); stops: the
    row's stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode, self.stops = decode, tuple(stops)
        self.hold = max((len(s) - 1 for s in self.stops), default=0)  # characters a stop may still claim
        self.stop: str | None = None  # the stop string that ended the row, once one has
        self._text, self._tokens = "", 0  # the text of the row's first `_tokens` tokens (cut at `stop`)

    def cut(self, tokens: Sequence[int], new: int) -> int | None:
        """Where a stop string ends the row: `tokens` are its tokens so far, the last `new` of them
        emitted this round. The number of those `new` it keeps (up to the one completing the first stop
        string its text reaches), or None when no stop string is complete."""
        if not self.stops or self.stop is not None:
            return None
        text = self._decoded(tokens)
        if not any(s in text for s in self.stops):
            return None
        before = len(tokens) - new  # the row's text up to these had no stop string
        for end in range(before + 1, len(tokens) + 1):
            part = self.decode(list(tokens[:end]))
            hits = [(part.find(s), s) for s in self.stops if s in part]
            if hits:
                at, self.stop = min(hits)
                self._text, self._tokens = part[:at], end
                return end - before
        return None  # unreachable: the whole text holds one

    def text(self, tokens: Sequence[int], finished: bool) -> str:
        """The row's text from its tokens so far: ending before its stop string; while it runs (not
        `finished`), without the end a stop string could still claim or a character still incomplete."""
        text = self._decoded(tokens)
        if finished:
            return text
        shown = len(text)  # a broken character first, then what a stop string may claim of the rest
        while shown and text[shown - 1] == BROKEN:
            shown -= 1
        return text[:max(0, shown - self.hold)]

    def _decoded(self, tokens: Sequence[int]) -> str:
        """The text of `tokens` (cut at the stop string once one ended the row), decoded once per count."""
        if self.stop is None and len(tokens) != self._tokens:
            self._text, self._tokens = self.decode(list(tokens)), len(tokens)
        return self._text


__all__ = ["BROKEN", "RowText", "text_of"]
