"""The decoding algorithm's compiled CPU calls (`rounds.cpp`): a round's greedy early-exit drafts in
one call, a draft step, the draft's choice from exit states (with η's probability), the greedy
verification, the sampled draft loop and verification (each row by its own settings: `sampling.py`'s
rules in C++), one row's rounds (greedy with their n-gram copies, or sampled), and the copies' tables
alone. Each greedy call is the engine's operations in the same order, so the same bits, without the
Python between them; `CpuKernelsBackend` (`cpu_kernels.py`) calls them.

They run the model's passes (`model/kernels/few_rows.cpp`, whose `few_rows.h` they include) and are
built into one extension with them by `model.kernels`, which holds it with its settings: each accessor
below takes its function from `model.kernels.extension()` (so `kernels.wrapped` wraps these too), or
returns None where the kernels are not available.
"""

from __future__ import annotations

from collections.abc import Callable

from ...model import kernels


def state_types() -> tuple | None:
    """The typed state the compiled calls take, (Passes, Head, Rounds), each made by keyword: `Passes(blocks,
    keys, values, embed, cos, sin, mask_value, row_starts=None)` (a range of blocks as the kernels' objects,
    their key and value buffers, the embedding table, the rotary rows, the mask's value, each row's first slot
    where rows sit apart), `Head(norm, eps, weight, bias=None, ids=None, vocab, stop_below=0.0)` (the final
    norm and a (trimmed) head with η), `Rounds(start, token, k, eos, max_tokens, max_rounds, history=None,
    min_ngram=1, max_ngram=0, copy_limit=0, overlap=False, sampling=[])` (one row's rounds); or None where the
    kernels are not available."""
    module = kernels.extension()
    return None if module is None else (module.Passes, module.Head, module.Rounds)


def draft_loop() -> Callable | None:
    """The compiled `draft_loop(low: Passes, draft: Head, token, start, k) -> [drafts (B, s), hidden
    (B, s + 1, D)]` (greedy early-exit drafts: k steps of `blocks_pass` over blocks [0, E), the draft head
    and the argmax, stopping below its η; [] where `blocks_pass` declines), or None where the kernels are
    not available."""
    module = kernels.extension()
    return None if module is None else module.draft_loop


def draft_choice() -> Callable | None:
    """The compiled `draft_choice(h (B, D), draft: Head, allowed) -> [draft (B,), top (B,)]` (greedy drafts
    from exit states: the final norm, the draft head, a grammar's mask (B, V) and the first maximum by token
    id in one pass, with each draft's probability where η > 0), or None where the kernels are not
    available."""
    module = kernels.extension()
    return None if module is None else module.draft_choice


def draft_step() -> Callable | None:
    """The compiled `draft_step(low: Passes, extra: Passes, draft: Head, tokens, start, allowed, choose) ->
    [draft (B,), hidden (B, T, D), sure (1,)]` (one greedy early-exit step: `blocks_pass` over blocks
    [0, E), then the exit blocks `extra`, the draft head, a grammar's mask and the argmax; `choose` false:
    the pass only; [] where `blocks_pass` declines), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.draft_step


def verify_greedy() -> Callable | None:
    """The compiled `verify_greedy(passes: Passes, target: Head, hidden, tokens, start, drafts, allowed) ->
    [decided (B, T + 1)]` (the target's pass, head, a grammar's masks, argmax and accepted prefix; [] where
    `blocks_pass` declines), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.verify_greedy


def draft_loop_sampled() -> Callable | None:
    """The compiled `draft_loop_sampled(low: Passes, draft: Head, token, start, k, sampling, positions) ->
    [drafts (B, s), q (B, s, V), hidden (B, s + 1, D)]` (`draft_loop` with each row's draft drawn by its own
    settings, `sampling` `RowSampling.tensors()`, at its DRAFT numbers; a greedy row's argmax), or None where
    the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.draft_loop_sampled


def verify_sampled() -> Callable | None:
    """The compiled `verify_sampled(passes: Passes, target: Head, hidden, tokens, start, drafts, q, sampling,
    positions) -> [decided (B, T + 1)]` (the target's pass and head, then each row's acceptance by its own
    settings: speculative sampling against q (B, T - 1, V), a greedy row's argmax), or None where the
    kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.verify_sampled


def greedy_rounds() -> Callable | None:
    """The compiled `greedy_rounds(model: Passes, exit_layer, target: Head, draft: Head, request: Rounds) ->
    [tokens (t,), rounds (R, 5), seconds (R, 2), drafts (d,)]` (one row's rounds at a fixed k: `draft_loop`
    and `verify_greedy` each round, or with `sampling` (the row's `RowSampling.tensors()`; [] greedy)
    `draft_loop_sampled` and `verify_sampled`; with `history` a copy of up to copy_limit tokens first, else a
    plain step (k = 0) or the early exit's drafts, a copy after them where they make one; with `overlap` a
    round's verification beside the next round's drafts, on two threads; the kept tokens cut at an eos and
    max_tokens; [] where `blocks_pass` declines), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.greedy_rounds


def ngram_search() -> type | None:
    """The compiled `NGramSearch(tokens, min_ngram, max_ngram)` (a list of ints; `.extend(tokens)`,
    `.propose(limit, extra=[]) -> list`): the copy drafter `greedy_rounds` runs, `ngram.NGramIndex`'s
    token lookup (no text matches) as a search from the sequence's end, or None where the kernels are
    not available."""
    module = kernels.extension()
    return None if module is None else module.NGramSearch


__all__ = ["draft_choice", "draft_loop", "draft_loop_sampled", "draft_step", "greedy_rounds", "ngram_search",
           "state_types", "verify_greedy", "verify_sampled"]
