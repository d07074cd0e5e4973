"""`SelfSpecGenerator`: self-speculative decoding with a shared KV cache, lossless, any batch size.

The draft model is the model's own first E blocks + its final norm + LM head. One round:

1. draft k tokens, one at a time, through blocks [0, E), keeping each step's exit hidden state;
2. verify: run the last draft through blocks [0, E), then blocks [E, N) once on the k + 1 kept
   hidden states. Blocks [0, E) wrote their KV cache while drafting and are never run again on
   those tokens;
3. accept the longest prefix the target agrees with (`sampling.accept_greedy`/`accept_sampled`),
   emit it plus the target's own next token, and roll every layer's cache back to what was kept.

The output is exactly the full model's (greedy: token for token; sampling: in distribution), and
k = 0 runs the very same code as plain decoding: one full forward per token on the same cache.

State between rounds, per row: the cache holds n positions (the prompt and the tokens emitted so
far, except the last), and the last emitted token is *pending* at position n. A round writes the
pending token and the drafts at positions n .. n + k and keeps n + (tokens emitted) of them. The
prefill runs every prompt token but the last, which is the first round's pending token, so the
very first generated token is already drafted and verified.

Batches run in lockstep rounds with one k; each row has its own positions, accepted length and
cache length (`cache.KVCache`), and a finished row leaves the batch at the end of its round. The
host reads the device once per round (the round's tokens and accepted counts), plus once per draft
step for η (`stop_below`) and for drafters that copy; everything else the loop needs (positions,
kv_length, cache lengths) is known on the host already.

One row decoding greedily with early-exit drafts (or plain steps) or with copies only, unconstrained,
runs its rounds in compiled calls of many rounds where the kernels apply (`Backend.greedy_rounds`):
the same passes, so the same tokens, without the host's Python between them; the statistics and the
policy then take the rounds' counts. A fixed k runs to the row's end in one call; an adaptive k (or
copy length) changes between calls of `ADAPT_ROUNDS` rounds; a call that streams or stops at strings
runs one round per call, and one with callbacks (`on_tokens`, `admit`: the server) `callback_rounds`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..backends import FusedDrafts, make_backend
from ..errors import UserError
from ..model import DecoderView
from . import sampling
from .cache import KVCache
from .controller import Controller
from .draft_head import DraftHead, frequent_tokens
from .engine import CallOptions, Engine
from .grammar import GrammarBatch, GrammarTokenizer, apply_mask, constraints_for_rows
from .ngram import NGramConfig, TokenText
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundCounts, RoundOutput
from .policy import DraftPlan, DraftPolicy, Segment
from .prefix import PrefixCache
from .profile import RoundProfile, no_lap
from .sampling import (
    ACCEPT,
    DRAFT,
    TARGET,
    SamplingParams,
    accept_greedy,
    accept_sampled,
    greedy_tokens,
    sample,
    uniforms,
)
from .settings import DecodeSettings


@dataclass
class _Batch:
    """Decoding state of the rows still running (see the module docstring); B shrinks as rows finish.

    The host arrays are the truth; the device copies are refreshed once per round (`_upload`).
    """

    cache: KVCache
    sampling: SamplingParams
    exit_layer: int  # E of this call's early exit
    head: DraftHead  # its draft head (trimmed to V', behind an MLP exit adapter, or the model's own)
    exit_block: object  # the attending exit adapter the drafts read (`ExitBlock`, KV at layers N..), or None
    loop_head: tuple | None  # the head as the compiled draft loop reads it (`DraftHead.tensors`), or None
    step_head: tuple | None  # the same for the compiled draft step (greedy early-exit drafts), or None
    stop_below: float  # η: stop a round's early-exit drafts when no row's top draft probability reaches it
    overlap: bool  # a compiled call's rounds verify while the next round drafts (`DecodeSettings.overlap`)
    grammar: GrammarBatch | None  # the rows' grammars (structured output), or None
    forced: bool  # draft the grammar's forced tokens (every drafter but plain decoding)
    steps: torch.Tensor  # arange(capacity) on the device, to build positions
    rows: np.ndarray  # (B,) the caller's row index of each batch slot
    lengths: np.ndarray  # (B,) positions the cache holds = position of the pending token
    pending_host: np.ndarray  # (B,) the last emitted token, not yet run through the model
    seeds_host: np.ndarray  # (B,) per-row random streams
    lengths_dev: torch.Tensor = None  # (B,) device copies of the three arrays above
    pending_dev: torch.Tensor = None
    seeds_dev: torch.Tensor = None
    _shared: np.ndarray = None  # on CPU: (3, B), the memory the three device tensors are views of
    lap: object = no_lap  # `RoundProfile.lap` of a profiled call: charges the time since the last lap

    def upload(self, device) -> None:
        """Refresh the device copies. On CPU they are views of one host array, written in place: no
        tensor is made per round (a round reads them before the next upload)."""
        rows = len(self.lengths)
        if device.type != "cpu" or self._shared is None or self._shared.shape[1] != rows:
            both = torch.from_numpy(np.stack([self.lengths, self.pending_host, self.seeds_host])).to(device)
            self._shared = both.numpy() if device.type == "cpu" else None
            self.lengths_dev, self.pending_dev, self.seeds_dev = both[0], both[1], both[2]
            return
        self._shared[0], self._shared[1], self._shared[2] = self.lengths, self.pending_host, self.seeds_host


@dataclass
class _Draft:
    """One round's draft (`SelfSpecGenerator._draft`), read by its verification (`_verify`).

    parts: the drafted tokens in position order, (B, r) each; q: how each was drafted, per part
    ("copy", tokens (B, r)) or per early-exit token ("early_exit", its draft logits (B, V));
    segments: the runs of positions per source; hiddens: exit hidden states (B, t, D) of the
    positions n .. that already ran through blocks [0, E); tail: the tokens (B, t) at positions
    n + len(hiddens' positions) .. n + k that still need that pass (the verification runs them
    first, so a round's last draft step is timed as verification, as it is its first part).
    """

    parts: list = field(default_factory=list)
    q: list = field(default_factory=list)
    segments: list = field(default_factory=list)
    hiddens: list = field(default_factory=list)
    tail: torch.Tensor = None
    stopped: bool = False  # the early exit stopped below η before the plan's last draft

    def add(self, source: str, tokens: torch.Tensor) -> None:
        """Drafts (B, r) from `source` at the next r draft positions. Consecutive drafts of one
        source make one `Segment`. Copied and forced drafts are deterministic: one-hot q."""
        start = self.k
        self.parts.append(tokens)
        last = self.segments[-1] if self.segments else None
        if last is not None and last.source == source:
            self.segments[-1] = Segment(source, last.start, last.length + tokens.shape[1])
        else:
            self.segments.append(Segment(source, start, tokens.shape[1]))
        if source != "early_exit":
            self.q.append(("copy", tokens))

    def host_tokens(self) -> np.ndarray:
        """(B, k) every draft of the round, on the host."""
        return self.tokens.cpu().numpy()

    @property
    def tokens(self) -> torch.Tensor:
        """(B, k) every draft of the round."""
        return _joined(self.parts) if self.parts else self.tail[:, :0]

    @property
    def k(self) -> int:
        return sum(part.shape[1] for part in self.parts)


def _decided(tokens: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """A round's outcome as one tensor (B, k+2): the tokens (B, k+1), then the accepted count (B,)."""
    return torch.cat([tokens, accepted[:, None].to(tokens.dtype)], 1)


def _joined(parts: list) -> torch.Tensor:
    """(B, r) tensors side by side along dimension 1; a single part is returned as it is (no copy:
    one tensor operation fewer in most rounds)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _width(parts: list) -> int:
    """Positions in a list of (B, r) token tensors."""
    return sum(part.shape[1] for part in parts)


class _RowOrderStream:
    """Feeds a Hugging Face-style streamer (`put`, `end`) with a batch's tokens, one row after another.

    Hugging Face's streamers take one sequence; a batch's rows would interleave. Row 0 streams live;
    a later row's tokens are buffered until every row before it has finished, then flushed.
    """

    def __init__(self, streamer, prompts: list[list[int]]):
        self.streamer = streamer
        self.buffers: list[list[int]] = [[] for _ in prompts]
        self.done = np.zeros(len(prompts), dtype=bool)
        self.current = 0  # the row that streams live
        streamer.put(torch.tensor(prompts[0]))

    def feed(self, outputs: list[RoundOutput]) -> None:
        """A step's emitted tokens, per row."""
        for out in outputs:
            self.buffers[out.row] += out.tokens
            self.done[out.row] |= out.finished
        while self.current < len(self.done):
            if self.buffers[self.current]:
                self.streamer.put(torch.tensor(self.buffers[self.current]))
                self.buffers[self.current] = []
            if not self.done[self.current]:
                break
            self.current += 1

    def end(self) -> None:
        self.streamer.end()


class SelfSpecGenerator:
    """Self-speculative decoding over a Hugging Face causal LM (llama, mistral, qwen2, qwen3, gpt2).

    model: the (tuned) causal LM, in eval mode; tokenizer: optional, needed for string prompts and
        stop strings; settings: the default `DecodeSettings` of `generate` (drafter, E, k, V', copy
        settings); the keywords exit_layer, num_speculations, drafter, draft_vocab_size, stop_below
        and ngram override its fields (`SelfSpecGenerator(model, exit_layer=4)` is the early exit at E = 4,
        k = "auto"). E = N drafts with the whole model (every draft accepted, useful as a check).
    token_counts: (V,) token frequencies that rank the V' ids of a trimmed draft head (needed for
        draft_vocab_size > 0; see `draft_head.py`); exit_adapters: {E: adapter} trained for those
        exits (`model.exit_adapter`: an `ExitAdapter`, or an `ExitBlock` with a KV cache of its own
        at cache layer N), applied to the exit's hidden states before the draft head (verification
        never reads them); check_cache: assert after every round that each layer's cache length
        equals the sequence length; fixed_width: run every decoding pass's products and attention
        on a fixed number of rows (`model.fast.fixed_width`; default: for bf16/fp16 models), which
        makes speculative output equal plain output in low precision too (Llama-family blocks;
        GPT-2's are Hugging Face's own and are not covered); format_settings: {constraint kind:
        settings}, the default of a `generate` call whose constrained rows all have that kind
        ("json_schema", "regex", "lark"), as a sweep on such prompts stored it.
    static_passes: None, or run every decoding pass of up to `static_passes.WIDTH` positions (plain
        steps, drafts, verifications; rounds are capped to that many) at fixed shapes, the path for
        CUDA graphs (`backends.static`): "eager" as written, "compile" through `torch.compile`
        (CUDA graphs on a GPU). The cache is then kept per batch size and length bucket and reused.
        Llama-family models only; greedy output equals plain decoding's with the same setting.
    backend: how the round's passes run (`selfspec.backends`): "reference" (torch operations, the
        oracle), "cpu_kernels" (selfspec's compiled CPU calls), "static" (fixed shapes; `static_passes`
        says which mode, "eager" by default); None: static when `static_passes` is given, else the CPU
        kernels on a CPU and the reference elsewhere.
    prefix_cache: a `PrefixCache` (`prefix.py`), or None: prompts prefill through it, a chunk per
        pass, reusing the chunks earlier calls computed; a prompt decodes to the same bits whether
        its chunks were cached or not (not always the bits of a prefill without one).
    """

    def __init__(self, model, tokenizer=None, settings: DecodeSettings | None = None, *,
                 exit_layer: int | None = None, num_speculations=None, drafter: str | None = None,
                 draft_vocab_size: int | None = None, stop_below: float | None = None,
                 ngram: NGramConfig | None = None, token_counts=None,
                 exit_adapters: dict | None = None, check_cache: bool = True,
                 fixed_width: bool | None = None, format_settings: dict | None = None,
                 static_passes: str | None = None, prefix_cache: PrefixCache | None = None,
                 backend: str | None = None):
        self.view = DecoderView(model)
        self.backend = make_backend(self.view, backend, static_passes)
        # the static backend's mode: caches then come in buckets, reused across calls
        self.static_passes = getattr(self.backend, "mode", None)
        self._static_buffers: dict[tuple, tuple] = {}  # (layers, rows, capacity) -> a cache's buffers
        # bf16/fp16: every decoding pass at one width (`model.fast.fixed_width`), so that a position
        # gets the same rounding alone (plain) as among k + 1 (verification); fp32 needs no help.
        self.fixed_width = (self.view.dtype in (torch.bfloat16, torch.float16) if fixed_width is None
                            else fixed_width)
        self.tokenizer = tokenizer
        settings = (settings or DecodeSettings()).override(
            exit_layer=exit_layer, num_speculations=num_speculations, drafter=drafter,
            draft_vocab_size=draft_vocab_size, stop_below=stop_below)
        self.token_counts = token_counts
        self.exit_adapters = dict(exit_adapters or {})
        self.check_cache = check_cache
        self.prefix_cache = prefix_cache
        self._heads: dict[tuple[int, int], DraftHead] = {}  # (E, V') -> its draft head, built once
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self.settings = self.settings_for(settings if ngram is None
                                          else dataclasses.replace(settings, ngram=ngram))
        self.format_settings = {kind: self.settings_for(s) for kind, s in (format_settings or {}).items()}

    @property
    def model(self):
        return self.view.model

    def settings_for(self, settings: DecodeSettings) -> DecodeSettings:
        """`settings` with E resolved for this model (the copy drafter needs none: E = N), or a UserError."""
        num_layers = self.view.num_layers
        if settings.exit_layer is None:
            if settings.drafter != "ngram" and not settings.is_plain:
                raise UserError("exit_layer is not set: pass exit_layer=E "
                                "(the number of blocks the draft runs)")
            settings = dataclasses.replace(settings, exit_layer=num_layers)
        if settings.exit_layer > num_layers:
            raise UserError(f"exit_layer must be an int in 1..{num_layers} "
                            f"(the number of blocks the draft runs), got {settings.exit_layer}")
        if settings.draft_vocab_size and self.token_counts is None:
            raise UserError(f"draft_vocab_size = {settings.draft_vocab_size} needs token counts to rank the "
                            f"ids: SelfSpecGenerator(..., token_counts=counts) or "
                            f"`selfspec draft-vocab MODEL`")
        return settings

    def draft_head(self, settings: DecodeSettings | None = None) -> DraftHead:
        """The draft head of `settings` (default the generator's): its E's MLP adapter, its V' ids."""
        settings = settings or self.settings
        key = (settings.exit_layer, settings.draft_vocab_size)
        if key not in self._heads:
            ids = (frequent_tokens(self.token_counts, settings.draft_vocab_size) if settings.draft_vocab_size
                   else None)
            adapter = self.exit_adapters.get(settings.exit_layer)
            self._heads[key] = DraftHead(self.view, ids, None if getattr(adapter, "attends", False)
                                         else adapter)
        return self._heads[key]

    def exit_block(self, settings: DecodeSettings):
        """The attending exit adapter the drafts of `settings` read (an `ExitBlock`), or None: none
        trained for its E, or a call that never drafts with the early exit (plain, copies only), which
        then does not pay for it."""
        adapter = self.exit_adapters.get(settings.exit_layer)
        if not getattr(adapter, "attends", False) or settings.is_plain or settings.drafter == "ngram":
            return None
        return adapter

    # -- the round -----------------------------------------------------------------------------------
    def _place(self, b: _Batch, offset: int, length: int) -> dict:
        """Positions n + offset .. n + offset + length - 1 of every row (B, T), announced to the cache:
        the cache/position arguments of `DecoderView.run_layers`."""
        positions = b.lengths_dev[:, None] + b.steps[offset:offset + length]
        kv_length = b.cache.set_positions(positions, b.lengths + offset)
        return {"cache": b.cache, "positions": positions, "kv_length": kv_length, "aligned": b.cache.aligned}

    def _run(self, b: _Batch, tokens: torch.Tensor, offset: int, end: int) -> torch.Tensor:
        """Tokens (B, T) at positions n + offset .. through blocks [0, end): hidden states (B, T, D)."""
        return self._forward(b, tokens, offset, end)[0]

    def _forward(self, b: _Batch, tokens: torch.Tensor, offset: int, end: int):
        """`_run`, and the draft head's input at those positions: the exit states (B, T, D) after the
        exit block when the call has one (else the states after block E, or None when end < E).

        An exit block keeps a KV cache of its own, so it runs wherever blocks [0, E) do (prefill,
        drafts, verification, plain steps): every layer then holds every position, and rollback and
        `check` treat it as one more layer."""
        place = self._place(b, offset, tokens.shape[1])
        if b.exit_block is not None and end == b.exit_layer and b.step_head is not None:
            out = self.backend.exit_pass(b.exit_layer, tokens, b.cache, place["positions"], b.step_head,
                                         b.exit_block)
            if out is not None:  # one compiled call: blocks [0, E), then the exit block
                return out
        hidden = self.view.embed(tokens, place["positions"])
        if b.exit_block is None or end < b.exit_layer:
            hidden = self.view.run_layers(hidden, 0, end, **place)
            return hidden, hidden if end == b.exit_layer else None
        context = self.view.context(hidden, place["positions"], place["kv_length"], cached=True,
                                    aligned=place["aligned"])
        hidden = self.view.run_layers(hidden, 0, b.exit_layer, b.cache, context=context)
        features = b.exit_block(hidden, self.view, context, b.cache)  # writes cache layers N, N + 1, ..
        return self.view.run_layers(hidden, b.exit_layer, end, b.cache, context=context), features

    def _pick(self, b: _Batch, logits: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Draft token (B,) from draft logits (B, V) for the token at `position` (B, 1)."""
        if b.sampling.greedy:
            return greedy_tokens(logits)
        return sample(b.sampling.probs(logits), uniforms(b.seeds_dev, position, DRAFT)[:, 0])

    @staticmethod
    def _unsure(b: _Batch, logits: torch.Tensor) -> bool:
        """Whether every row's draft distribution (B, V) puts less than η on its most likely token
        (Kangaroo's stopping rule). It reads only the draft, so the output stays the target's."""
        probs = torch.softmax(logits.float(), -1) if b.sampling.greedy else b.sampling.probs(logits)
        return bool((probs.max(-1).values < b.stop_below).all())  # one small host read per draft step

    def _round(self, b: _Batch, plan: DraftPlan, policy: DraftPolicy, clock, cap: int):
        """One round for every row: draft, verify all drafts in one pass, accept a prefix.

        Returns decided (B, k+2): per row the tokens (k + 1) then the accepted count, three timestamps
        (start, drafted, verified) and the `_Draft` (its `Segment`s, whether η stopped it). A row emits
        tokens[:accepted + 1]: its accepted drafts, then the target's own token (the correction after
        a rejection, the bonus after a full acceptance). k = 0 is one plain decoding step.
        """
        start = clock.mark()
        draft = self._draft(b, plan, policy, cap)
        drafted = clock.mark()
        decided = self._verify(b, draft)
        return decided, (start, drafted, clock.mark()), draft

    def _draft(self, b: _Batch, plan: DraftPlan, policy: DraftPolicy, cap: int) -> _Draft:
        """The round's drafts, at most `cap`: first the free ones (a grammar's forced tokens, then
        `plan.copied` (B, m) copied tokens, see `_free_drafts`), then up to `plan.extend` early-exit
        drafts, each through blocks [0, E) + final norm + draft head, one at a time, each followed by
        the free drafts it makes possible: under a grammar its forced tokens (the early exit then
        goes on after them); when the policy turns the rest of the round into a copy
        (`policy.copy_after`), the copy ends it. Tokens without an exit hidden state yet (the
        pending token, copied and forced drafts) run through blocks [0, E) together, in one parallel
        pass, when the early exit next needs their state; an early-exit draft keeps its own step's."""
        draft = _Draft()
        unrun = [b.pending_dev[:, None]]  # (B, r) each: tokens not yet through blocks [0, E), in order
        copied = self._free_drafts(b, draft, unrun, policy, cap, plan.copied)
        extend = 0 if copied and not plan.num_copied else plan.extend  # a copy found on the way ends it
        compiled = extend and not draft.k and b.loop_head is not None
        if compiled and self._draft_loop(b, draft, min(extend, cap)):
            # a policy that copies after early-exit drafts looks once, after them all (the step-by-step
            # loop looks after each): other drafts, the same output
            if policy.copies_after_early_exit and not draft.stopped and draft.k < cap:
                unrun = []
                self._free_drafts(b, draft, unrun, policy, cap)
                if unrun:
                    draft.tail = _joined(unrun)
            return draft
        for _ in range(extend):
            if draft.k >= cap:
                break
            allowed = None
            if b.grammar is not None:  # the draft picks among what the grammar allows: q is masked too
                allowed = b.grammar.mask()  # (B, V)
                b.lap("grammar")
            step = self._draft_step(b, draft, unrun, allowed) if unrun and b.step_head is not None else None
            if step is not None:  # one compiled call: pass, exit block, head, mask, argmax, η
                token, sure = step
                unrun = []
                if not sure:
                    draft.stopped = True
                    break
            else:
                if unrun:  # this step's input: the tokens since the last pass through blocks [0, E)
                    hidden, features = self._forward(b, _joined(unrun), draft.k + 1 - _width(unrun),
                                                     b.exit_layer)  # (B, r, D) each
                    draft.hiddens.append(hidden)
                    unrun = []
                # greedy: the compiled steps' own choice where it runs, so both draft alike
                chosen = (self.backend.draft_choice(features[:, -1], b.step_head, allowed, b.stop_below)
                          if b.step_head is not None else None)
                if chosen is not None:
                    token, sure = chosen
                    b.lap("draft passes")
                    if not sure:  # η: no row trusts this draft; verify the rest
                        draft.stopped = True
                        break
                else:
                    logits = b.head.logits(features[:, -1])  # (B, V)
                    b.lap("draft passes")
                    if allowed is not None:
                        logits = apply_mask(logits, allowed)
                        b.lap("grammar")
                    if b.stop_below and self._unsure(b, logits):  # η: no row trusts this draft
                        draft.stopped = True
                        b.lap("draft choice")
                        break
                    token = self._pick(b, logits, b.lengths_dev[:, None] + (draft.k + 1))  # at n + k + 1
                    draft.q.append(("early_exit", logits))
            draft.add("early_exit", token[:, None])
            unrun.append(token[:, None])
            b.lap("draft choice")
            if b.grammar is not None:
                b.grammar.admit(token[:, None].cpu().numpy())
                b.lap("grammar")
            if draft.k < cap and (b.forced or policy.copies_after_early_exit):
                if self._free_drafts(b, draft, unrun, policy, cap):  # a copy ends the round
                    break
        # The drafts after the last pass through blocks [0, E) are the verification's first part; when
        # η stopped the round every token already had that pass (B, 0), even with no early-exit draft.
        draft.tail = _joined(unrun) if unrun else b.pending_dev[:, None][:, :0]
        b.lap("draft choice")
        return draft

    def _draft_loop(self, b: _Batch, draft: _Draft, k: int) -> bool:
        """The round's k greedy early-exit drafts in one compiled call (`Backend.draft_loop`), the
        same drafts and the same cache as the step-by-step loop of `_draft`, without the Python between
        the steps. Its last pass through blocks [0, E) runs the last draft (which `_verify` would run
        first), so the draft time holds it. Whether it ran (else nothing was run)."""
        place = self._place(b, 0, k + 1)
        out = self.backend.draft_loop(b.exit_layer, b.pending_dev, b.cache, place["positions"], b.loop_head,
                                      k, b.stop_below)
        if out is None:
            return False
        drafts, hidden = out  # (B, s), (B, s + 1, D)
        if drafts.shape[1]:
            draft.add("early_exit", drafts)
        draft.hiddens.append(hidden)
        draft.stopped = drafts.shape[1] < k
        draft.tail = drafts[:, :0]
        b.lap("draft passes")
        return True

    def _draft_step(self, b: _Batch, draft: _Draft, unrun: list, allowed: torch.Tensor | None):
        """One greedy early-exit step of `_draft` in one compiled call (`Backend.draft_step`): the
        tokens `unrun` through blocks [0, E) and the exit block, the draft head, the grammar's mask
        `allowed` (B, V) and the argmax, as the step from Python does them. (draft (B,), sure: some row's
        draft reaches η), the exit states appended to `draft`; or None, nothing run."""
        tokens = _joined(unrun)  # (B, r)
        place = self._place(b, draft.k + 1 - tokens.shape[1], tokens.shape[1])
        out = self.backend.draft_step(b.exit_layer, tokens, b.cache, place["positions"], b.step_head,
                                      b.exit_block, allowed, b.stop_below)
        if out is None:
            return None
        token, hidden, sure = out
        draft.hiddens.append(hidden)
        b.lap("draft passes")
        return token, sure

    def _free_drafts(self, b: _Batch, draft: _Draft, unrun: list, policy: DraftPolicy, cap: int,
                     copy: np.ndarray | None = None) -> bool:
        """Drafts that take no model call, appended to `draft` and `unrun`: a grammar's forced tokens,
        then a copy (`copy` (B, r), or the policy's `copy_after` the drafts so far), cut at the first
        token every row's grammar refuses; under a grammar, forced tokens and copies alternate while
        either finds something, the round's copies `policy.copy_limit()` tokens in all: each copied
        draft is verified at a cost, and a chain of copies is rarely accepted to its end (a forced
        token is certain once the drafts before it are accepted). Whether a copy was added."""
        copied = False
        limit = policy.copy_limit()
        room = cap if limit is None else limit - sum(s.length for s in draft.segments if s.source == "copy")
        while draft.k < cap:
            forced = None
            if b.forced:
                forced = b.grammar.forced(cap - draft.k)
                b.lap("grammar")
            if forced is not None and forced.shape[1]:
                draft.add("forced", torch.as_tensor(forced, device=b.steps.device))
                unrun.append(draft.parts[-1])
                copy = None  # the copy was looked up before the forced tokens
                b.lap("draft choice")
            if copy is None:  # the policy reads the drafts on the host: ask only one that can copy
                if not draft.k or not (policy.copies if b.grammar is not None
                                       else policy.copies_after_early_exit):
                    break
                copy = policy.copy_after(b.rows, draft.host_tokens())
                b.lap("policy")
            copy = copy[:, :min(cap - draft.k, room)]
            if copy.shape[1] and b.grammar is not None:
                copy = self._closed_copy(b, copy)
                b.lap("grammar")
            if not copy.shape[1]:
                break
            draft.add("copy", torch.as_tensor(copy, device=b.steps.device))
            unrun.append(draft.parts[-1])
            b.lap("draft choice")
            copied, copy, room = True, None, room - copy.shape[1]
            if b.grammar is None:  # unconstrained, one copy ends the free drafts
                break
        return copied

    def _closed_copy(self, b: _Batch, copy: np.ndarray) -> np.ndarray:
        """A copy (B, r) under a grammar, consumed by the rows' drafting matchers, cut at the first token
        every row refuses; and where the context's clause ends inside it (`TokenText.clause_end`: `,`, `.`
        or `;` before a space) and the grammar can close the value there, cut there and closed with a
        closer (`TokenText.closers`: `",`, `"}`, `"`, `,`, `}`, the first each row allows). A value
        copied from the prompt ends where its clause does (`Charles Dixon, 89` -> `Charles Dixon",`),
        and the forced key after it follows in the same round. (B, r') the drafts to add."""
        text = self.token_text
        end = text.clause_end(copy) if text is not None else None
        if end is None:
            return copy[:, :b.grammar.admit(copy)]
        kept = b.grammar.admit(copy[:, :end])
        if kept < end:
            return copy[:, :kept]
        closers = b.grammar.first_allowed(text.closers)  # (B,) or None: no row may close here
        if closers is None:
            return copy[:, :end + b.grammar.admit(copy[:, end:])]
        b.grammar.admit(closers[:, None])
        return np.concatenate([copy[:, :end], closers[:, None]], 1)

    def _verify(self, b: _Batch, draft: _Draft):
        """Run the target on the k + 1 positions n .. n + k, then accept the longest prefix of the
        drafts it agrees with: decided (B, k+2), the tokens (B, k+1) then the accepted count of each
        row (`_round`), one tensor for the round's one host read. Blocks [0, E) wrote their KV cache
        while drafting and are not run again on the drafts; only the draft's tail runs them."""
        view, num_layers, k = self.view, self.view.num_layers, draft.k
        done = sum(h.shape[1] for h in draft.hiddens)  # positions that already ran through [0, E)
        allowed = None
        if b.grammar is not None:  # (B, k+1, V): the grammar's masks at each drafted prefix
            allowed = b.grammar.verification_masks(draft.host_tokens())
            b.lap("grammar")
        if b.sampling.greedy:  # the verification may run in one compiled call
            out = self._verify_compiled(b, draft, done, allowed)
            if out is not None:
                b.lap("verification pass")
                return out
        if not draft.hiddens:  # no early-exit draft: every block at once
            hidden = self._run(b, draft.tail, 0, num_layers)  # (B, k+1, D)
        else:
            tail = [self._run(b, draft.tail, done, b.exit_layer)] if draft.tail.shape[1] else []
            hidden = torch.cat([*draft.hiddens, *tail], 1)  # (B, k+1, D)
            if b.exit_layer < num_layers:
                hidden = view.run_layers(hidden, b.exit_layer, num_layers, **self._place(b, 0, k + 1))
        p_logits = view.exit_logits(hidden)  # (B, k+1, V)
        if allowed is not None:  # the target at each drafted prefix, masked by the grammar there
            p_logits = apply_mask(p_logits, allowed)
        b.lap("verification pass")
        if b.sampling.greedy:
            return _decided(*accept_greedy(draft.tokens, p_logits))
        # q: one-hot for copied and forced drafts (deterministic given the context), the early exit's
        # processed (and masked) distribution for its own drafts.
        vocab = p_logits.shape[-1]
        q = torch.cat([p_logits[:, :0], *(sampling.copied_probs(part, vocab) if source == "copy"
                                          else b.sampling.probs(part)[:, None]
                                          for source, part in draft.q)], 1)  # (B, k, V)
        decided = b.lengths_dev[:, None] + b.steps[1:k + 2]  # (B, k+1): positions n+1 .. n+k+1
        return _decided(*accept_sampled(draft.tokens, q, b.sampling.probs(p_logits),
                                        uniforms(b.seeds_dev, decided[:, :k], ACCEPT),
                                        uniforms(b.seeds_dev, decided, TARGET)))

    def _verify_compiled(self, b: _Batch, draft: _Draft, done: int, allowed: torch.Tensor | None):
        """`_verify` of a greedy round in one compiled call (`Backend.verify_greedy`): the draft's
        tail through blocks [0, E) first when it has one (from Python), then the target's pass, its head,
        the grammar's masks `allowed` (B, k + 1, V) when given, the argmax and the accepted prefix; a
        round without early-exit drafts (a plain step, a copy, forced tokens) as one whole-model call,
        unless an exit block must see its positions (then blocks [0, E) run from Python first).
        decided (B, k+2) as `_verify`'s, or None with nothing run but the tail."""
        num_layers = self.view.num_layers
        if not draft.hiddens and b.exit_block is None:  # a whole-model call
            positions = self._place(b, 0, draft.k + 1)["positions"]
            return self.backend.verify_greedy(0, num_layers, b.cache, positions, draft.tokens,
                                              tokens=draft.tail, allowed=allowed)
        if draft.tail.shape[1]:  # through blocks [0, E) from Python: an exit block writes its cache there
            draft.hiddens.append(self._run(b, draft.tail, done, b.exit_layer))
            draft.tail = draft.tail[:, :0]
        hidden = _joined(draft.hiddens)  # (B, k+1, D)
        positions = self._place(b, 0, draft.k + 1)["positions"]
        return self.backend.verify_greedy(b.exit_layer, num_layers, b.cache, positions, draft.tokens,
                                          hidden=hidden, allowed=allowed)

    # -- generation ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, input_ids, attention_mask=None, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, num_speculations=None, drafter=None,
                 eos_token_id=None, stop_strings=None, seed=None, streamer=None,
                 settings: DecodeSettings | None = None, json_schema=None, regex=None,
                 grammar=None, profile: bool = False, on_tokens=None, admit=None,
                 callback_rounds: int = 1, draft_max_rows: int | None = None) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens per prompt; the result is exactly the full model's.

        input_ids: a list of token lists (any lengths), one token list, a (B, T) tensor with an
            optional `attention_mask` (left or right padding), or strings when a tokenizer is set.
        temperature/top_k/top_p: 0 = greedy; the same processing applies to draft and target.
        settings: how to draft (`DecodeSettings`); None uses the generator's. num_speculations and
            drafter override its k and drafter: k an int (0: plain decoding, whatever the drafter:
            no copies either), "auto" (cost model), "window" (the articles' rule) or a
            `Controller`; drafter "early_exit", "ngram" or "hybrid" (see `policy.py`), or a
            `DraftPolicy` that plans the rounds itself.
        eos_token_id: int or list; None = the model's own (generation config, then config, then
            tokenizer); [] = never stop at eos. The eos token is included in the output.
        stop_strings: strings that end a row once its decoded output contains one (needs a
            tokenizer); the token completing it is the last one kept.
        seed: int (row i uses seed + i), a list of per-row seeds, or None (drawn from torch's global
            generator). Each row's numbers depend only on its own seed and positions, so with a fixed
            k a row's result does not depend on its batch-mates; a batch-shared adaptive k changes
            where rounds end and thus which numbers are used, never the distribution.
        streamer: an object with Hugging Face's streamer interface (`put(token_ids)`, `end()`), e.g.
            `transformers.TextStreamer`. As in Hugging Face's generate, `put` first receives the
            prompt (the first row's), then the accepted tokens of each round as they are decided, then
            `end()` is called. The rows of a batch stream one after another in row order: row 0 live,
            each later row's tokens held back until the rows before it have finished.
        json_schema/regex/grammar: structured output (needs `selfspec[structured]` and a fast
            tokenizer): a JSON schema (dict or JSON text), a regex or a Lark grammar the output must
            follow, one for every row or a list with one per row (None: that row is free). The
            output is then exactly constrained decoding's: the target's tokens masked by the grammar
            (see `grammar.py`). A row ends when its grammar is complete; `GenerationOutput.complete`
            says which rows' outputs are (False: max_new_tokens cut it first).
        profile: time each part of every round (`profile.PARTS`) into `GenerationStats.profile`.
        on_tokens: called after every round with `(rows, tokens, emit, finished, counts)`: the
            caller's row index of each running row (B,), the round's tokens (B, w) of which each row
            keeps its first `emit` (B,), which rows end with this round (B,) bool, and the
            `RoundCounts` behind them. It may return a (B,) bool array of rows to end now (a server's
            cancelled request, a limit the caller keeps per row); their tokens so far stay in the
            output. Every row streams live, unlike `streamer`.
        admit: continuous batching: called before every round with no argument, it returns the
            `NewRow`s that join the batch now (an empty list: none). They are prefilled apart and
            decode with the others from this round on, with their own `max_new_tokens`; their caller
            rows follow the prompts' (and the rows joined before them). Their tokens reach
            `on_tokens` and the output. A row's tokens do not depend on when it joined (greedy; a
            sampled row draws from its own seed). The call ends when no row runs and none joins.
        callback_rounds: with `on_tokens` or `admit`, the rounds a lone row may run in one compiled call
            between two callbacks (its first round always alone, so its first token comes at once): more
            rounds cost less host time, but rows wait longer to join and tokens arrive in bursts.
        draft_max_rows: a greedy round of more running rows than this drafts nothing (a plain step);
            0: no greedy round drafts; None: every round drafts. Where a pass costs about in proportion
            to its rows times k + 1 positions (a CPU past a few positions), a rejected draft costs what
            a kept token does and a batch decodes faster plainly. Greedy only, so the output is the
            same either way; a sampled row's tokens then still do not depend on its batch-mates (a
            plain step draws other numbers than a round).
        """
        prompts = self._prompts(input_ids, attention_mask)
        constraints = constraints_for_rows(len(prompts), json_schema, regex, grammar)
        kinds = {c.kind for c in constraints or () if c is not None}
        if settings is None and len(kinds) == 1 and kinds <= self.format_settings.keys():
            settings = self.format_settings[kinds.pop()]  # the format's own fastest
        settings, policy = self._resolve(settings, drafter, num_speculations)
        if self.view.model.training:
            warnings.warn("the model is in training mode (dropout on): outputs will not match eval mode",
                          stacklevel=2)
        if admit is not None and streamer is not None:
            raise UserError("admit and streamer do not go together: follow joined rows with on_tokens")
        stops = self._stop_strings(stop_strings)
        sampling = SamplingParams(temperature, top_k, top_p)
        options = CallOptions(settings, sampling, self._eos_ids(eos_token_id),
                              tuple(stops or ()), seed, constraints is not None, draft_max_rows,
                              callback_rounds if on_tokens is not None or admit is not None else None,
                              streamer is not None or bool(stops), profile)
        engine = Engine(self, policy, options, on_round=on_tokens)
        stream = _RowOrderStream(streamer, prompts) if streamer is not None else None
        if max_new_tokens <= 0:
            if stream:
                stream.end()
            texts = [""] * len(prompts) if self.tokenizer else None
            return GenerationOutput([[] for _ in prompts], engine.stats, texts,
                                    None if constraints is None else [c is None for c in constraints])
        for row, prompt in enumerate(prompts):
            engine.add(NewRow(prompt, max_new_tokens, constraint=None if constraints is None
                              else constraints[row]))
        engine.start()
        while True:  # finished rows leave the batch, admitted ones join it
            for row in (admit() or []) if admit is not None else []:
                engine.add(row)
            if engine.done:
                break
            outputs = engine.step()
            if stream:
                stream.feed(outputs)
        if stream:
            stream.end()
        return engine.output()

    def engine(self, settings: DecodeSettings | None = None, *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, eos_token_id=None, structured: bool = False, rounds_per_step: int = 1,
               draft_max_rows: int | None = None) -> Engine:
        """A decode to step yourself (`engine.Engine`): `add(NewRow(prompt, max_new_tokens, seed))` returns
        the row, `step()` runs a round and returns each running row's `RoundOutput`, `cancel(row)` ends
        one, `output()` gives what `generate` returns. settings: how to draft (default the generator's);
        structured: rows may carry output constraints (`NewRow.constraint`); rounds_per_step: a lone
        greedy row's rounds per step where the CPU kernels run them in one call (its first step one
        round); draft_max_rows: as `generate`'s."""
        settings, policy = self._resolve(settings, None, None)
        sampling = SamplingParams(temperature, top_k, top_p)
        options = CallOptions(settings, sampling, self._eos_ids(eos_token_id), grammar=structured,
                              callback_rounds=rounds_per_step, draft_max_rows=draft_max_rows)
        return Engine(self, policy, options)

    def chat(self, messages, **kwargs) -> GenerationOutput:
        """Reply to a conversation, a list of {"role", "content"} messages (or to a list of
        conversations, one row each), through the tokenizer's chat template with the generation
        prompt; keywords as `generate`'s. The texts leave out special tokens (the end of the turn)."""
        if not messages:
            raise UserError("chat needs a conversation: a list of {'role', 'content'} messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        out = self.generate([self.chat_prompt(c) for c in conversations], **kwargs)
        out.texts = [self.tokenizer.decode(s, skip_special_tokens=True) for s in out.sequences]
        return out

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The token ids of one conversation through the chat template, ending with the generation
        prompt (the assistant's turn opened)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("chat needs a tokenizer with a chat template (an instruct model's); "
                            "use generate for a plain continuation")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _resolve(self, settings, drafter, num_speculations) -> tuple[DecodeSettings, DraftPolicy]:
        """This call's settings (the generator's, then `settings`, then the two overrides) and policy."""
        settings = self.settings_for(settings) if settings is not None else self.settings
        if isinstance(drafter, DraftPolicy):
            return settings, drafter
        controller = num_speculations if isinstance(num_speculations, Controller) else None
        if type(num_speculations) is int and num_speculations == 0:
            drafter = "early_exit"  # k = 0 asked for: plain decoding, whatever drafter the settings name
        settings = self.settings_for(settings.override(
            drafter=drafter, num_speculations=None if controller is not None else num_speculations))
        return settings, settings.policy(controller)

    @functools.cached_property
    def token_text(self) -> TokenText | None:
        """The vocabulary's pieces for copies matched on the text (`ngram.TokenText`); None without a
        tokenizer."""
        return TokenText(self.tokenizer) if self.tokenizer is not None else None

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """llguidance's index of the tokenizer (structured output), built on first use."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.view.vocab_size,
                                                       self._eos_ids(None).tolist())
        return self._grammar_tokenizer

    def _check_positions(self, prompt_length: int, max_new_tokens: int) -> None:
        """A UserError when a prompt and its token limit pass the model's positions."""
        limit = self.view.max_positions
        if limit is not None and prompt_length + max_new_tokens > limit:
            raise UserError(f"a prompt of {prompt_length} tokens plus "
                            f"max_new_tokens = {max_new_tokens} exceeds the model's {limit} positions; "
                            f"shorten the prompt or lower max_new_tokens")

    def _join(self, b: _Batch, joining: list[NewRow], first: int, policy: DraftPolicy,
              settings: DecodeSettings, k_max: int) -> int:
        """Rows joining the running batch `b` (continuous batching) as caller rows first, first + 1, ...:
        prefilled in a cache of their own (`_start`), then appended to `b`'s rows, cache (grown to the
        capacity they need) and grammars. Returns how many joined."""
        for row in joining:  # `Engine.add` checked the rest
            self._check_positions(len(row.prompt), row.max_new_tokens)
        constraints = [row.constraint for row in joining]
        prompts = [list(row.prompt) for row in joining]
        greedy = b.sampling.greedy
        seeds = [(0 if greedy else int(torch.randint(0, 2**31 - 1, ()))) if row.seed is None else row.seed
                 for row in joining]
        capacity = max(b.cache.capacity, max(len(p) + r.max_new_tokens for p, r in zip(prompts, joining))
                       + k_max + 1)
        # a cache of their own: b's may be the pool's (`_cache`)
        new = self._start(prompts, b.sampling, seeds, settings, capacity, pooled=False)
        policy.add(prompts)
        if b.grammar is not None:
            b.grammar.add(constraints)
        b.cache.add_rows(new.cache)
        b.rows = np.concatenate([b.rows, first + np.arange(len(joining))])
        b.lengths = np.concatenate([b.lengths, new.lengths])
        b.pending_host = np.concatenate([b.pending_host, new.pending_host])
        b.seeds_host = np.concatenate([b.seeds_host, new.seeds_host])
        if b.steps.numel() < b.cache.capacity:
            b.steps = torch.arange(b.cache.capacity, device=b.steps.device)
        b.upload(b.steps.device)
        return len(joining)

    def _start(self, prompts, sampling, seed, settings: DecodeSettings, capacity: int,
               grammars: GrammarBatch | None = None, forced: bool = False, pooled: bool = True) -> _Batch:
        """Allocate the cache and prefill every prompt token but the last (the first pending token)."""
        device, rows = self.view.device, len(prompts)
        exit_block = self.exit_block(settings)
        head = self.draft_head(settings)
        extra_layers = 0 if exit_block is None else exit_block.cache_layers
        b = _Batch(cache=self._cache(self.view.num_layers + extra_layers, rows, capacity, pooled),
                   sampling=sampling, exit_layer=settings.exit_layer, head=head, exit_block=exit_block,
                   loop_head=(head.tensors() if sampling.greedy and grammars is None and exit_block is None
                              and not settings.is_plain else None),
                   step_head=head.tensors() if sampling.greedy and not settings.is_plain else None,
                   stop_below=settings.stop_below, overlap=settings.overlap, grammar=grammars, forced=forced,
                   steps=torch.arange(capacity, device=device), rows=np.arange(rows),
                   lengths=np.zeros(rows, dtype=np.int64),
                   pending_host=np.array([p[-1] for p in prompts], dtype=np.int64),
                   seeds_host=np.array(self._seeds(seed, rows, sampling.greedy), dtype=np.int64))
        b.upload(device)
        width = max(len(p) for p in prompts) - 1
        if self.prefix_cache is not None:
            for row, prompt in enumerate(prompts):
                self._prefill_chunks(b, row, prompt[:-1])
        elif width > 0:  # right-padded with token 0; the padding's slots are stale, hidden, overwritten
            ids = torch.tensor([p[:-1] + [0] * (width - len(p) + 1) for p in prompts], device=device)
            self._run(b, ids, 0, self.view.num_layers)
        b.lengths = np.array([len(p) - 1 for p in prompts], dtype=np.int64)
        b.cache.rollback(b.lengths)
        b.upload(device)
        return b

    def _prefill_chunks(self, b: _Batch, row: int, tokens: list[int]) -> None:
        """Row `row`'s prompt `tokens` (all but its pending last) into `b`'s cache through the prefix
        cache (`prefix.py`): the chunks it holds loaded, the rest run a chunk per pass, on this row
        alone (in a one-row batch of its own when `b` has more), then kept for later calls."""
        if not tokens:
            return
        cache = self.prefix_cache
        one = b if len(b.rows) == 1 else dataclasses.replace(
            b, cache=self._cache(b.cache.num_layers, 1, b.cache.capacity, pooled=False), rows=np.arange(1),
            lengths=np.zeros(1, dtype=np.int64), pending_host=b.pending_host[row:row + 1],
            seeds_host=b.seeds_host[row:row + 1], _shared=None)
        if one is not b:
            one.upload(self.view.device)
        layout = cache.layout(self.view.model, b.exit_block, one.cache.num_layers)
        hits, loaded = cache.match(layout, tokens), 0
        for chunk in hits:
            one.cache.write_slots(0, loaded, chunk.keys, chunk.values)
            loaded += len(chunk.tokens)
        ids = torch.tensor([tokens], device=self.view.device)
        for start, end in cache.spans(len(tokens))[len(hits):]:
            self._run(one, ids[:, start:end], start, self.view.num_layers)
        cache.prefilled_tokens += len(tokens) - loaded
        cache.store(layout, tokens, lambda start, end: one.cache.read_slots(0, start, end))
        if one is not b:
            b.cache.write_slots(row, 0, *one.cache.read_slots(0, 0, len(tokens)))

    def _cache(self, layers: int, rows: int, capacity: int, pooled: bool = True) -> KVCache:
        """An empty cache of at least `capacity` slots per row. With static passes, its buffers made at
        once, at a power-of-two capacity, and (`pooled`: a call's own batch, not rows joining it) one
        set per batch size and capacity kept and written again by the next call: captured passes are
        specific to the shapes and, under CUDA graphs, to the addresses of the buffers they write (the
        old slots are stale, hidden). So a generator with static passes decodes one call at a time."""
        if self.static_passes is None:
            return KVCache(layers, rows, capacity)
        capacity = self.backend.capacity(capacity)
        key = (layers, rows, capacity)
        cache = KVCache(layers, rows, capacity, buffers=self._static_buffers.get(key) if pooled else None)
        if not pooled or key not in self._static_buffers:
            self.backend.allocate(cache)
        if pooled:
            self._static_buffers.setdefault(key, (tuple(cache.keys), tuple(cache.values)))
        return cache

    def _advance(self, b: _Batch, tokens: np.ndarray, emit: np.ndarray, keep: np.ndarray) -> None:
        """Keep each row's emitted tokens (the last becomes pending, the cache rolls back to the rest),
        then drop finished rows from the batch so that no round is spent on them."""
        b.pending_host = tokens[np.arange(len(emit)), emit - 1]  # every running row emits >= 1 token
        b.lengths = b.lengths + emit
        b.cache.rollback(b.lengths)
        self._keep_rows(b, keep)

    @staticmethod
    def _keep_rows(b: _Batch, keep: np.ndarray) -> None:
        """Only the rows `keep` (B,) bool stay in the batch (finished or cancelled ones leave)."""
        if not keep.all():
            b.rows, b.lengths, b.pending_host, b.seeds_host = (
                b.rows[keep], b.lengths[keep], b.pending_host[keep], b.seeds_host[keep])
            b.cache.select_rows(np.nonzero(keep)[0])
            if b.grammar is not None:
                b.grammar.select_rows(np.nonzero(keep)[0])
        b.upload(b.steps.device)

    def _rounds_in_one_call(self, b: _Batch, policy: DraftPolicy, rounds_per_call: int) -> bool:
        """Whether a row's rounds may run several in one call of the backend (`_greedy_rounds`): a backend
        with fused rounds, greedy, unconstrained, no exit block, a policy whose rounds fuse
        (`DraftPolicy.fuses`), and early-exit drafts only with a head the compiled draft loop reads."""
        if (not self.backend.fused_rounds or not b.sampling.greedy or b.grammar is not None
                or b.exit_block is not None):
            return False
        return policy.fuses(rounds_per_call) and (not policy.drafts_early_exit or b.loop_head is not None)

    def _greedy_rounds(self, b: _Batch, drafts: FusedDrafts, eos: np.ndarray, max_tokens: int,
                       max_rounds: int, stats: GenerationStats, policy: DraftPolicy,
                       laps: RoundProfile | None):
        """Up to `max_rounds` rounds of the batch's one row in one call of the backend
        (`Backend.greedy_rounds`), drafting as `drafts` says (the policy's k and copies), each round
        recorded in `stats` and shown to `policy` as the rounds from Python record them: (tokens (1, t)
        the row kept, emit (1,) = t, finished (1,): an eos or `max_tokens` reached, the call's
        `RoundCounts`), or None, nothing run, where the backend declines."""
        k = drafts.k
        head = b.loop_head if k else b.head.tensors()
        if head is None:
            return None
        drafts = dataclasses.replace(drafts, exit_layer=b.exit_layer, head=head, eta=b.stop_below)
        out = self.backend.greedy_rounds(int(b.pending_host[0]), b.cache, int(b.lengths[0]), drafts,
                                         torch.from_numpy(eos), max_tokens, max_rounds, b.overlap)
        if out is None:
            return None
        tokens, rounds, seconds = out
        if laps is not None:  # the call's own clock splits its time; the rest of it is acceptance
            laps.split({"draft passes": float(seconds[:, 0].sum()),
                        "verification pass": float(seconds[:, 1].sum())}, rest="acceptance")
        for (early, copied, accepted, _, ahead), (draft_time, verify_time) in zip(rounds.tolist(),
                                                                                 seconds.tolist()):
            segments = [Segment(source, start, length) for source, start, length in
                        (("early_exit", 0, early), ("copy", early, copied)) if length]
            if not segments:  # a plain step, also one whose first E blocks ran before η stopped the draft
                draft_time, verify_time = 0.0, draft_time + verify_time
            stats.stopped_below_eta += early < k and not (copied and not early)  # a copy round drafts no exit
            stats.drafted_ahead += ahead
            self._record(stats, segments, np.array([accepted]), draft_time, verify_time)
            policy.update(segments, np.array([accepted]), draft_time, verify_time)
        b.lap("statistics")
        finished = len(tokens) >= max_tokens or bool(len(tokens) and np.isin(tokens[-1], eos))
        early, copied, accepted = np.asarray(rounds, dtype=np.int64).reshape(-1, 5)[:, :3].sum(0)
        done = RoundCounts(np.array([len(rounds)]), np.array([early + copied]), np.array([accepted]))
        return np.asarray(tokens, dtype=np.int64)[None], np.array([len(tokens)]), np.array([finished]), done

    @staticmethod
    def _record(stats: GenerationStats, segments: list[Segment], accepted: np.ndarray, draft_time: float,
                verify_time: float) -> None:
        k = sum(s.length for s in segments)
        stats.log_round(segments, accepted, k)
        if k:
            # copies and forced tokens take none
            stats.draft_steps += sum(s.length for s in segments if s.source == "early_exit")
            stats.draft_time += draft_time
            stats.verify_time += verify_time
        else:
            stats.plain_steps += 1
            stats.plain_time += verify_time

    @staticmethod
    def _emit_counts(tokens, accepted, counts, max_new_tokens, eos):
        """Tokens each running row keeps from this round, cut after an eos and at the limit; finished rows."""
        emit = np.minimum(accepted + 1, max_new_tokens - counts)
        hit_eos = np.zeros(len(emit), dtype=bool)
        if eos.size:
            # (B, k+1, n_eos) compared at once: np.isin sorts, several times slower on a round's few tokens
            hits = (tokens[..., None] == eos).any(-1) & (np.arange(tokens.shape[1]) < emit[:, None])
            hit_eos = hits.any(1)
            emit = np.where(hit_eos, hits.argmax(1) + 1, emit)
        return emit, hit_eos | (counts + emit >= max_new_tokens)

    def _cut_at_stop_strings(self, stops, generated, rows, counts, emit) -> np.ndarray:
        """Shorten `emit` (in place) to end at the token completing a stop string; the slots that stop."""
        stopped = np.zeros(len(emit), dtype=bool)
        for slot, row in enumerate(rows):
            tokens = generated[row, :counts[slot] + emit[slot]].tolist()
            if not any(s in self.tokenizer.decode(tokens) for s in stops):
                continue
            for end in range(counts[slot] + 1, len(tokens) + 1):
                if any(s in self.tokenizer.decode(tokens[:end]) for s in stops):
                    emit[slot] = end - counts[slot]
                    stopped[slot] = True
                    break
        return stopped

    # -- inputs --------------------------------------------------------------------------------------
    def _prompts(self, input_ids, attention_mask) -> list[list[int]]:
        if isinstance(input_ids, str) or (isinstance(input_ids, Sequence) and input_ids
                                          and all(isinstance(x, str) for x in input_ids)):
            if self.tokenizer is None:
                raise UserError("string prompts need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
            texts = [input_ids] if isinstance(input_ids, str) else list(input_ids)
            prompts = [list(self.tokenizer(text)["input_ids"]) for text in texts]
        elif isinstance(input_ids, torch.Tensor):
            ids = input_ids if input_ids.dim() == 2 else input_ids[None]
            if attention_mask is None:
                prompts = ids.tolist()
            else:
                mask = attention_mask.reshape(ids.shape).bool()
                prompts = [row[keep].tolist() for row, keep in zip(ids, mask)]
        elif isinstance(input_ids, Sequence) and input_ids and all(isinstance(x, int) for x in input_ids):
            prompts = [list(input_ids)]
        else:
            prompts = [[int(t) for t in row] for row in input_ids]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UserError("every prompt needs at least one token")
        return prompts

    @staticmethod
    def _seeds(seed, rows: int, greedy: bool) -> list[int]:
        if seed is None:  # greedy needs no random numbers: leave torch's global generator alone
            seed = 0 if greedy else int(torch.randint(0, 2**31 - 1, ()))
        if isinstance(seed, int):
            return [seed + row for row in range(rows)]
        seeds = [int(s) for s in seed]
        if len(seeds) != rows:
            raise UserError(f"seed: got {len(seeds)} per-row seeds for {rows} prompts")
        return seeds

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a row by default: the generation config's, else the config's, else the
        tokenizer's (what `generate(eos_token_id=None)` uses)."""
        return self._eos_ids(None).tolist()

    def _eos_ids(self, eos_token_id) -> np.ndarray:
        if eos_token_id is None:
            generation_config = getattr(self.view.model, "generation_config", None)
            eos_token_id = getattr(generation_config, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.view.config, "eos_token_id", None)
            if eos_token_id is None and self.tokenizer is not None:
                eos_token_id = self.tokenizer.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        if isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        return np.array(list(eos_token_id), dtype=np.int64)

    def _stop_strings(self, stop_strings) -> list[str]:
        if not stop_strings:
            return []
        if self.tokenizer is None:
            raise UserError("stop_strings need a tokenizer: SelfSpecGenerator(model, tokenizer, ...)")
        return [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)


__all__ = ["GenerationOutput", "GenerationStats", "SelfSpecGenerator"]
