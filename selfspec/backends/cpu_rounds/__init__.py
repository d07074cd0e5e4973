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


def draft_loop() -> Callable | None:
    """The compiled `draft_loop(blocks, embed, token, keys, values, start, cos, sin, norm, eps, head, bias,
    ids, vocab, k, stop_below) -> [drafts (B, s), hidden (B, s + 1, D)]` (greedy early-exit drafts: k steps of
    `blocks_pass` over blocks [0, E), the draft head and the argmax, stopping below stop_below; [] where
    `blocks_pass` declines), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.draft_loop


def draft_choice() -> Callable | None:
    """The compiled `draft_choice(h (B, D), norm, eps, head (V', D), bias, ids, vocab, allowed, stop_below) ->
    [draft (B,), top (B,)]` (greedy drafts from exit states: the final norm, the draft head, a grammar's
    mask (B, V) and the first maximum by token id in one pass, with each draft's probability for η
    where stop_below > 0), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.draft_choice


def draft_step() -> Callable | None:
    """The compiled `draft_step(blocks, extra, embed, tokens, keys, values, start, cos, sin, mask_value, norm,
    eps, head, bias, ids, vocab, allowed, stop_below, row_starts) -> [draft (B,), hidden (B, T, D), sure
    (1,)]`
    (one greedy early-exit step: `blocks_pass` over blocks [0, E), then the exit blocks `extra`, the
    draft head, a grammar's mask and the argmax; [] where `blocks_pass` declines), or None where the
    kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.draft_step


def verify_greedy() -> Callable | None:
    """The compiled `verify_greedy(blocks, hidden, tokens, embed, keys, values, start, cos, sin, mask_value,
    norm, eps, head, bias, drafts, allowed) -> [decided (B, T + 1)]` (the target's pass, head,
    a grammar's masks, argmax and accepted prefix; [] where `blocks_pass` declines), or None where the
    kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.verify_greedy


def draft_loop_sampled() -> Callable | None:
    """The compiled `draft_loop_sampled(blocks, embed, token, keys, values, start, cos, sin, norm, eps, head,
    bias, ids, vocab, k, stop_below, sampling, positions, row_starts, mask_value) -> [drafts (B, s), q (B, s,
    V), hidden (B, s + 1, D)]` (`draft_loop` with each row's draft drawn by its own settings, `sampling`
    `RowSampling.tensors()`, at its DRAFT numbers; a greedy row's argmax), or None where the kernels are not
    available."""
    module = kernels.extension()
    return None if module is None else module.draft_loop_sampled


def verify_sampled() -> Callable | None:
    """The compiled `verify_sampled(blocks, hidden, tokens, embed, keys, values, start, cos, sin, mask_value,
    norm, eps, head, bias, drafts, q, sampling, positions, row_starts) -> [decided (B, T + 1)]` (the target's
    pass and head, then each row's acceptance by its own settings: speculative sampling against q (B, T - 1,
    V), a greedy row's argmax), or None where the kernels are not available."""
    module = kernels.extension()
    return None if module is None else module.verify_sampled


def greedy_rounds() -> Callable | None:
    """The compiled `greedy_rounds(blocks, exit_layer, embed, keys, values, start, token, cos, sin,
    mask_value, norm, eps, head, bias, draft_head, draft_bias, ids, vocab, k, stop_below, eos, max_tokens,
    max_rounds, history, min_ngram, max_ngram, copy_limit, overlap, sampling) -> [tokens (t,), rounds (R, 5),
    seconds (R, 2)]` (one row's rounds at a fixed k: `draft_loop` and `verify_greedy` each round, or with
    `sampling` (the row's `RowSampling.tensors()`; [] greedy) `draft_loop_sampled` and `verify_sampled`; with
    `history` a copy of up to copy_limit tokens first, else a plain step (k = 0) or the early exit's
    drafts, a copy after them where they make one; with `overlap` a round's verification beside the
    next round's drafts, on two threads; the kept tokens cut at an eos and max_tokens; [] where
    `blocks_pass` declines), or None where the kernels are not available."""
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
           "verify_greedy", "verify_sampled"]
