"""The early exit's draft loop, written once in torch: k draft steps, each draft the next step's input.

A round's early-exit drafts come from k steps of the model's first E blocks, the final norm and the draft
head, each step's draft fed to the next, and one pass more for the last draft (the verification reads its
exit state). `draft_loop` is that loop over two functions a caller supplies: `step`, one position through
blocks [0, E) with its keys and values written (a backend's pass, or the engine's passes through the model),
and `head`, the draft logits of an exit state. The engine's proposer runs it through the model's passes
(`decoding.proposers.EarlyExitProposer`); the static backend runs the same function as written and
captures it, unrolled k steps, as one CUDA graph (`backends.static_passes`). The CPU kernels' compiled loop
(`backends/cpu_rounds`) is the one second expression, tested against it round for round.

η (Kangaroo's stopping rule, `DecodeSettings.stop_below`) is no branch inside the loop: every step runs and
returns its top draft probability, and `keep_sure` cuts the drafts after the loop with `sampling.sure_drafts`
(one host read), so a captured loop holds no host read; the steps past the cut ran for nothing, their keys
stale past the cache's length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampling import DRAFT, RowSampling, greedy_tokens, sample, sure_drafts

Step = Callable[[torch.Tensor, int], torch.Tensor]  # (token (B,), i) -> exit state (B, D)
Head = Callable[[torch.Tensor], torch.Tensor]  # exit state (B, D) -> draft logits (B, V)


def draft_loop(step: Step, head: Head, token: torch.Tensor, positions: torch.Tensor, k: int,
               sampling: RowSampling | None = None, stop_below: float | None = None) -> tuple:
    """k early-exit drafts from `token` (B,), the pending token at positions[:, 0].

    step(token (B,), i): the exit state (B, D) of `token` at positions[:, i] after blocks [0, E), its
    keys and values written; head(state (B, D)): the draft logits (B, V), -inf off a trimmed head's ids.
    positions (B, k + 1): the inputs' positions. sampling: None, or rows that are all greedy, take each
    argmax (the lowest id on a tie); else each row draws from its processed draft distribution with its
    own random numbers at the position the draft takes (`RowSampling.uniforms`, stream DRAFT), a greedy
    row its argmax. stop_below: None for a loop that must run every step (a captured one): each step's
    top draft probability is returned for `keep_sure` to cut after; else η for a loop run as written, which
    stops at the first step where no row's draft puts η on its top token (one host read a step; 0: never),
    as the engine's step-by-step drafts do, and needs no cut.

    Returns (drafts (B, s), q (B, s, V) the drafts' distributions or None when greedy, tops (s, B) or
    None, states (B, s + 1, D): the exit states of the pending token and of every draft), s = k but where
    η stopped the loop.
    """
    drafts, qs, tops, states = [], [], [], []
    for i in range(k + 1):
        state = step(token, i)
        states.append(state)
        if i == k:  # the last draft's pass: its exit state only
            break
        logits = head(state).float()  # (B, V)
        top = None
        if stop_below is None or stop_below > 0:  # the probability of each row's most likely draft
            top = logits.softmax(-1).amax(-1) if sampling is None else sampling.top_probability(logits)
        if stop_below and not sure_drafts(top[None], stop_below):  # η: no row trusts this step's draft
            break
        token, probs = pick(logits, sampling, positions[:, i:i + 1] + 1)  # draft i takes position i + 1
        if probs is not None:
            qs.append(probs)
        if stop_below is None:
            tops.append(top)
        drafts.append(token)
    stacked = torch.stack(drafts, 1) if drafts else token[:, None][:, :0]
    return (stacked, torch.stack(qs, 1) if qs else None, torch.stack(tops) if tops else None,
            torch.stack(states, 1))


def pick(logits: torch.Tensor, sampling: RowSampling | None, position: torch.Tensor) -> tuple:
    """One draft step's choice from draft logits (B, V) for the token at `position` (B, 1): (draft (B,), q)
    with q None where every row is greedy (`sampling` None or all greedy: each argmax, the lowest id on a
    tie), else each row's processed draft distribution (B, V) and its draw from it with the row's own
    random numbers at that position (`RowSampling.uniforms`, stream DRAFT; a greedy row's one-hot q draws
    its argmax)."""
    if sampling is None or sampling.all_greedy:
        return greedy_tokens(logits), None
    probs = sampling.probs(logits)
    return sample(probs, sampling.uniforms(position, DRAFT)[:, 0], on_host=not sampling.in_capture), probs


def keep_sure(drafts: torch.Tensor, q: torch.Tensor | None, tops: torch.Tensor | None, states: torch.Tensor,
              stop_below: float) -> tuple:
    """`draft_loop`'s result cut by η: the drafts before the first step at which no row's draft puts
    `stop_below` on its top token (`sampling.sure_drafts`; all of them where η is 0 or `tops` None).
    Returns (drafts (B, s), q (B, s, V) or None, states (B, s + 1, D))."""
    count = drafts.shape[1] if tops is None else sure_drafts(tops, stop_below)
    return drafts[:, :count], None if q is None else q[:, :count], states[:, :count + 1]


def trimmed_logits(sub: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """A trimmed draft head's logits (..., V') over its token `ids` (V',) as logits over the whole
    vocabulary (..., V), -inf elsewhere (q is 0 there; an argmax breaks a tie at the lowest id as over the
    full head); `sub` itself for the full head (ids None)."""
    if ids is None:
        return sub
    return sub.new_full(sub.shape[:-1] + (vocab,), float("-inf")).index_copy(-1, ids, sub)


__all__ = ["draft_loop", "keep_sure", "pick", "trimmed_logits"]
