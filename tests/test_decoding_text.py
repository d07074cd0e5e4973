"""A row's text and its stop strings (`decoding.text.RowText`): OpenAI's semantics, token by token."""

from __future__ import annotations

from selfspec.decoding.text import BROKEN, RowText

PIECES = ["Hel", "lo", " wor", "ld", "!", " Bye"]  # token i decodes to PIECES[i]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def run(stops, per_round=1):
    """Feed the tokens `per_round` at a time as an engine's rounds would: (kept tokens, text, stop)."""
    text, tokens = RowText(decode, stops), []
    for start in range(0, len(PIECES), per_round):
        new = list(range(start, min(start + per_round, len(PIECES))))
        kept = text.cut(tokens + new, len(new))
        tokens += new if kept is None else new[:kept]
        if kept is not None:
            break
    return tokens, text.text(tokens, True), text.stop


def test_a_stop_string_ends_the_row_at_the_token_completing_it_and_the_text_before_it():
    for per_round in (1, 2, 6):  # however many tokens a round emits
        assert run(("o w",), per_round) == ([0, 1, 2], "Hell", "o w")
        assert run(("!",), per_round) == ([0, 1, 2, 3, 4], "Hello world", "!")
        assert run(("xyz",), per_round) == ([0, 1, 2, 3, 4, 5], "Hello world! Bye", None)


def test_the_first_stop_string_the_text_completes_wins_and_the_text_ends_at_its_start():
    # "world" completes at token 3, "lo" at token 1: the row stops at token 1
    assert run(("world", "lo"), 6) == ([0, 1], "Hel", "lo")
    # both complete with token 3; the text ends at the earlier one's start
    assert run(("ld", "o world"), 6) == ([0, 1, 2, 3], "Hell", "o world")


def test_a_running_rows_text_holds_back_what_a_stop_string_or_a_broken_character_may_still_change():
    text = RowText(decode, ("ld!?",))
    assert text.text([0, 1, 2], False) == "Hello "  # the last 3 characters may begin the stop string
    assert text.text([0, 1, 2], True) == "Hello wor"
    broken = RowText(lambda ids: "ab" + BROKEN * len(ids))
    assert broken.text([7, 7], False) == "ab" and broken.text([7, 7], True) == "ab" + BROKEN * 2
    assert RowText(decode).text([0, 1], False) == "Hello"  # no stop strings: nothing held back


def test_a_broken_character_at_the_end_does_not_shorten_what_a_stop_string_holds_back():
    """Byte-level tokens, the last character's bytes not all there (U+FFFD each): the hold-back of a stop
    string counts from the last whole character, so nothing streamed is taken back by the final text."""
    pieces = [b"a", b"b", *(bytes([x]) for x in "😀".encode()), b"c"]

    def decode_bytes(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    text, tokens, shown = RowText(decode_bytes, ("b😀",)), [], []
    for token in range(len(pieces)):
        kept = text.cut(tokens + [token], 1)
        tokens += [token] if kept is None else [token][:kept]
        if kept is not None:
            break
        shown.append(text.text(tokens, False))
    final = text.text(tokens, True)
    assert final == "a" and all(final.startswith(s) for s in shown), (shown, final)
