"""The backend protocol (`Backend`) and what a proposer hands fused rounds (`FusedDrafts`); see the
package's docstring."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from ..model.view import DecoderView

STATIC_MODES = ("eager", "graph")


@dataclass(frozen=True)
class FusedDrafts:
    """What a proposer hands a backend's fused rounds (`Backend.greedy_rounds`): how it drafts for one
    row, as numbers and tensors, so that no backend reads a proposer's internals.

    k: early-exit drafts per round (0: none, and with no copies a plain step); exit_layer: E; head: the
    draft head's tensors (`DraftHead.tensors()`); stop_below: η, the early exit's stopping rule (0: never
    stop); history: the row's tokens so far (t,) int64 when rounds copy from the context first (None:
    no copies); min_ngram, max_ngram: the copy's match lengths; copy_length: the longest copy a round
    drafts."""

    k: int = 0
    exit_layer: int = 0
    head: tuple | None = None
    stop_below: float = 0.0
    history: np.ndarray | None = None
    min_ngram: int = 0
    max_ngram: int = 0
    copy_length: int = 0

    def copies(self) -> tuple | None:
        """(history, min_ngram, max_ngram, copy_length) as the kernels take them, or None without copies."""
        if self.history is None:
            return None
        return torch.from_numpy(self.history), self.min_ngram, self.max_ngram, self.copy_length


class Backend:
    """The protocol (and the reference behaviour: every operation declined, see the module docstring).

    view: the model's `DecoderView`. A backend is made per generator; `name` says which it is,
    `fused_rounds` whether `greedy_rounds` may run, `max_pass_positions` and `pools_caches` what
    the engine must respect of its passes and caches. Arguments follow the engine's round: `cache` a
    `decoding.KVCache` with the round's positions announced, `positions` (B, T) those positions, `head`
    a draft head's tensors (`DraftHead.tensors()`: weight (V', D), bias or None, ids (V',) or None, V),
    `stop_below` η (0: never stop)."""

    name = "base"
    # whether it may have calls of the round's draft loop and verification (`draft_loop`, `verify_greedy`,
    # `verify_sampled`): where not (the reference backend), the engine runs them from Python without asking
    round_calls = True
    fused_rounds = False  # the capability `greedy_rounds`
    max_pass_positions: int | None = None  # the most positions one pass takes (a round's k + 1); None: any
    pools_caches = False  # whether caches are made through `capacity`/`allocate` and kept for the next call
    verifies_sampled = False  # whether `verify_sampled` may run (else the engine verifies sampled rounds)
    # whether `draft_step`/`draft_choice` may choose greedy drafts: the engine's greedy steps then take its
    # choice, and a round whose `draft_loop` it declined drafts step by step, so that every path chooses alike
    chooses_drafts = False

    def __init__(self, view: DecoderView):
        self.view = view

    def active(self) -> contextlib.AbstractContextManager:
        """A context the engine enters around its passes: the backend's switches for this thread."""
        return contextlib.nullcontext()

    def capacity(self, capacity: int) -> int:
        """The cache capacity to make for at least `capacity` slots (a static backend rounds it to a
        bucket, so that captured passes are reused)."""
        return capacity

    def allocate(self, cache) -> None:
        """Give a new cache its buffers before its first pass, where the backend needs fixed addresses."""

    def draft_loop(self, exit_layer: int, token: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                   k: int, stop_below: float = 0.0, sampling=None):
        """The early exit's drafts in one call, as `selfspec.draft_loop.draft_loop` makes them: from `token`
        (B,) at `positions[:, 0]`, k steps of blocks [0, exit_layer) + final norm + draft head, each draft
        the next step's input, greedy (each argmax; `sampling` None or all rows greedy) or drawn from each
        row's processed draft distribution with its own random numbers (`sampling`, a
        `sampling.RowSampling`: `RowSampling.uniforms`' DRAFT stream at the position the draft takes),
        then cut where no row's draft puts `stop_below` on its top token (`draft_loop.keep_sure`).
        positions (B, k + 1). Returns (drafts (B, s), their distributions q (B, s, V) or None when greedy,
        exit states (B, s + 1, D): every input that ran, the last draft included unless η stopped first),
        the cache holding those s + 1 positions at blocks [0, exit_layer); or None."""
        return None

    def draft_step(self, exit_layer: int, tokens: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                   exit_block=None, allowed: torch.Tensor | None = None, stop_below: float = 0.0):
        """One greedy early-exit step in one call: `tokens` (B, T) at `positions` (B, T) through blocks
        [0, exit_layer), then `exit_block`'s blocks (an `ExitBlock`, each at its own cache layer) when
        given, the final norm and draft head on the last position, a grammar's mask `allowed` (B, V)
        bool, the argmax. Returns (draft (B,), hidden (B, T, D) after block E, sure: whether some row's
        draft puts `stop_below` on its top token), the cache holding the T positions; or None."""
        return None

    def exit_pass(self, exit_layer: int, tokens: torch.Tensor, cache, positions: torch.Tensor, head: tuple,
                  exit_block=None):
        """`draft_step`'s pass without its choice: (hidden (B, T, D) after block E, the exit states
        (B, T, D) the draft head reads); or None."""
        return None

    def draft_choice(self, hidden: torch.Tensor, head: tuple, allowed: torch.Tensor | None = None,
                     stop_below: float = 0.0):
        """Greedy drafts from exit states `hidden` (B, D): the final norm, the draft head, a grammar's
        mask `allowed` (B, V) bool, the argmax, as `draft_loop` and `draft_step` choose. Returns
        (drafts (B,), sure), or None."""
        return None

    def verify_greedy(self, start: int, end: int, cache, positions: torch.Tensor, drafts: torch.Tensor,
                      hidden: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None):
        """Greedy verification in one call: blocks [start, end) on the T positions `positions` (B, T),
        causal over them, then the final norm, the LM head, a grammar's masks `allowed` (B, T, V) bool,
        the argmax and the accepted prefix of `drafts` (B, T - 1), as `sampling.accept_greedy`. The
        input: `hidden` (B, T, D), or `tokens` (B, T) embedded (start = 0). Returns decided (B, T + 1):
        the tokens (B, T), then each row's accepted count; or None."""
        return None

    def verify_sampled(self, start: int, end: int, cache, positions: torch.Tensor, drafts: torch.Tensor,
                       q: torch.Tensor, sampling, hidden: torch.Tensor | None = None,
                       tokens: torch.Tensor | None = None, allowed: torch.Tensor | None = None):
        """`verify_greedy` for sampled decoding: the same pass, then the target's probabilities as
        `sampling` (a `sampling.RowSampling`) processes them and `sampling.accept_sampled`'s rule against
        the drafts' distributions `q` (B, T - 1, V), with the rows' random numbers (their seeds; ACCEPT
        and TARGET streams at the positions decided, each slot's position + 1). Returns decided
        (B, T + 1); or None."""
        return None

    def greedy_rounds(self, token: int, cache, start: int, drafts: FusedDrafts, eos: torch.Tensor,
                      max_tokens: int, max_rounds: int, overlap: bool = False, sampling=None):
        """The capability `fused_rounds`: one row's rounds in one call, greedy, or with `sampling` (the
        row's `sampling.RowSampling`, early-exit drafts only: no copies) each draft drawn and each round
        accepted by speculative sampling's rule as `draft_loop` and `verify_sampled` do, from the
        pending `token` at slot `start` of `cache` (one row, every layer holding `start` positions). Each
        round drafts as
        `drafts` says (a copy from the context first where it has copies; else k early-exit drafts,
        stopping below η, a copy after them where they make one; k = 0 and no copy: a plain step) and
        verifies them; the row keeps the accepted drafts and the target's next token, cut after an eos
        (`eos` (n,) int64) and at `max_tokens` in all, for up to `max_rounds` rounds. With `overlap`, a
        round's verification runs beside the next round's drafts (`DecodeSettings.overlap`), keeping
        only drafts a fresh round would make. Returns numpy (tokens (t,), rounds (R, 5): early-exit
        drafts, copied drafts, accepted, kept, drafted ahead; seconds (R, 2): draft and verification
        seconds; drafts (d,): every round's drafts in order), the cache holding start + t positions; or
        None."""
        return None


__all__ = ["Backend", "FusedDrafts", "STATIC_MODES"]
