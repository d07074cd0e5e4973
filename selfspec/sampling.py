"""Logits processing, per-row random numbers, and the accept/reject rule of speculative decoding: the
arithmetic every decoding path shares, the engine's rounds (`selfspec.decoding`) and the backends' passes
(`selfspec.backends`, which capture it) alike. Pure tensor functions of the model's logits; it imports
nothing of the package's but its errors.

Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a draft token d drawn from
the draft distribution q is accepted with probability min(1, p(d)/q(d)), where p is the target
distribution; on rejection a replacement is drawn from the residual max(0, p − q), normalised; if
every draft of the round is accepted, a bonus token is drawn from the target's next distribution.
Every emitted token is then distributed exactly as the target model's. Two conditions make that
true here:

- p and q come out of the same processing (`RowSampling.probs`: temperature, then top-k, then
  top-p, each row by its own request's settings), so sampling the target alone would draw from
  exactly that p;
- the random numbers are fresh for every decision. They come from a counter-based generator
  (`uniforms`): a hash of (row seed, position of the token being decided, stream). A row's draws
  therefore never depend on its batch-mates, need no per-row generator objects, and stay on the
  device. A position that is drafted again after a rejection reuses its numbers, which is sound:
  the tokens kept so far are a function of the numbers of earlier positions only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .errors import UserError

# Streams of random numbers: one per kind of decision taken for the token at a position.
DRAFT, ACCEPT, TARGET = 0, 1, 2
# The logits a row's top-k/top-p filters look among on the CPU, unless its top-k asks for more: a
# partial selection (`topk`) instead of a sort of the whole vocabulary; a top-p cut past them (a flat
# distribution) sorts after all.
CANDIDATES = 256


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution, identically for the draft and the target.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k largest logits (0: all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """'greedy', or the settings that sample, e.g. 'temperature 0.8, top-p 0.95' (reports' words)."""
        if self.greedy:
            return "greedy"
        return ", ".join([f"temperature {self.temperature:g}"] + [f"top-k {self.top_k}"] * (self.top_k > 0)
                         + [f"top-p {self.top_p:g}"] * (self.top_p < 1))

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> float32 logits, filtered tokens at -inf (temperature, top-k, top-p): one
        row's `RowSampling.process`."""
        return RowSampling.of([self], logits.device).process(logits)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., V) logits -> (..., V) float32 probabilities after processing."""
        return self.process(logits).softmax(-1)


@dataclass(frozen=True)
class RowSampling:
    """Each row's `SamplingParams` as device tensors (B,), so that rows with other settings share a batch
    and one captured pass serves every setting (vLLM's per-request sampling).

    temperature: float32, 1 on greedy rows (their logits are left as they are); top_k: int64, 0 off;
    top_p: float32, 1 off; greedy: bool, the rows that take the argmax; seeds: int64, each row's seed of
    its counter-based random numbers (`uniforms`) (their distribution one-hot, so
    that speculative sampling's rule accepts exactly the drafts the argmax would: `accept_sampled` on
    one-hot p and q is `accept_greedy`). Host facts: all_greedy, whether every row is greedy (the
    batch then takes the greedy paths); any_greedy, whether some row is; filters, whether the
    top-k/top-p pass runs at all; max_top_k, the largest top-k asked; in_capture, whether these are a
    captured pass's (no host reads then). A captured pass takes the tensors alone (`tensors`, `captured`)
    and assumes both passes may be needed, so that one graph serves every setting. A row's processed logits
    do not depend on its batch-mates: rows whose settings filter nothing keep every logit bit for bit
    whether the pass runs or not.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    greedy: torch.Tensor
    seeds: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    filters: bool
    max_top_k: int = 0
    in_capture: bool = False

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device, seeds: Sequence[int] | None = None) -> RowSampling:
        """The rows' settings `params` and `seeds` (one each per row; None: zeros) on `device`: made when
        rows start, join or leave, not every round, from two host tables (the floats, the integers)."""
        temperatures = [1.0 if p.greedy else p.temperature for p in params]
        floats = torch.tensor([temperatures, [p.top_p for p in params]], dtype=torch.float32, device=device)
        ints = torch.tensor([[p.top_k for p in params], [p.greedy for p in params],
                             [0] * len(params) if seeds is None else [int(s) for s in seeds]],
                            dtype=torch.int64, device=device)
        return cls(floats[0], ints[0], floats[1], ints[1] == 1, ints[2], **_facts(params))

    def select(self, keep: list[int], params: Sequence[SamplingParams]) -> RowSampling:
        """The rows `keep` (their indices) of these settings, `params` theirs on the host."""
        return RowSampling(self.temperature[keep], self.top_k[keep], self.top_p[keep], self.greedy[keep],
                           self.seeds[keep], **_facts(params))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, greedy, seeds): what a captured pass takes as inputs."""
        return self.temperature, self.top_k, self.top_p, self.greedy, self.seeds

    @classmethod
    def captured(cls, tensors: tuple[torch.Tensor, ...]) -> RowSampling:
        """`tensors()` back into settings inside a captured pass, which samples and holds every path
        (the filters, greedy rows' one-hot) whatever the rows ask: one graph for every setting."""
        return cls(*tensors, all_greedy=False, any_greedy=True, filters=True, in_capture=True)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, ..., V) logits -> float32 logits, each row divided by its temperature, then its top-k and
        top-p filters (tokens at -inf). Greedy rows keep their logits (see `probs`)."""
        logits = logits.float() / _rows(self.temperature, logits)  # x / 1 is x: greedy rows unchanged
        if not self.filters:
            return logits
        vocab = logits.shape[-1]
        if logits.device.type == "cpu" and not self.in_capture:  # a host read costs nothing: few candidates
            out = self._filter(logits, min(vocab, max(CANDIDATES, self.max_top_k)))
            if out is not None:
                return out
        return self._filter(logits, vocab)

    def _filter(self, logits: torch.Tensor, candidates: int) -> torch.Tensor | None:
        """`process`'s top-k and top-p on temperature-scaled logits (B, ..., V), found among each row's
        `candidates` largest logits (all V: a full sort; fewer: `topk`, no sort of the vocabulary). With
        fewer than V, None (nothing returned) where some row's top-p cut may lie past its candidates:
        their mass, by the full distribution, stays below its top_p."""
        vocab = logits.shape[-1]
        if candidates < vocab:
            sorted_logits, order = torch.topk(logits, candidates, dim=-1)  # (B, ..., C), descending
        else:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        # top-k: the k-th largest logit stays with everything at or above it (k = 0: every logit)
        top_k = _rows(self.top_k, logits)
        has_k = (top_k > 0) & (top_k < vocab)
        kth = sorted_logits.gather(-1, (torch.where(has_k, top_k, vocab) - 1).clamp_max(candidates - 1)
                                   .expand(*logits.shape[:-1], 1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        # top-p: drop a token when the more likely tokens already reach top_p (the first one always
        # stays), by the distribution after top-k; a row with top_p = 1 drops nothing, whatever its
        # probabilities' rounding
        total = logits.logsumexp(-1, keepdim=True)  # the normaliser of a row without top-k
        if self.max_top_k:  # a row with top-k: its kept candidates'
            total = torch.where(has_k, sorted_logits.logsumexp(-1, keepdim=True), total)
        sorted_probs = (sorted_logits - total).exp()
        top_p = _rows(self.top_p, logits)
        before = sorted_probs.cumsum(-1) - sorted_probs
        if candidates < vocab and bool(((before[..., -1:] + sorted_probs[..., -1:] < top_p)
                                        & (top_p < 1.0) & ~has_k).any()):
            return None
        keep = ~((before >= top_p) & (top_p < 1.0)) & (sorted_logits > float("-inf"))
        kept = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, keep)
        # rows that filter nothing keep every logit (a candidate set holds only some)
        kept |= ~(has_k | (top_p < 1.0))
        return logits.masked_fill(~kept, float("-inf"))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, ..., V) logits -> (B, ..., V) float32 probabilities after processing; a greedy row's is
        one-hot at its argmax (`greedy_tokens`)."""
        probs = self.process(logits).softmax(-1)
        if not self.any_greedy:
            return probs
        one_hot = F.one_hot(greedy_tokens(logits), logits.shape[-1]).to(probs.dtype)
        return torch.where(_rows(self.greedy, logits), one_hot, probs)

    def uniforms(self, positions: torch.Tensor, stream: int) -> torch.Tensor:
        """The rows' random numbers (`uniforms`) at `positions` (B, T): on the CPU outside a captured pass
        in numpy's uint32 arithmetic (`_host_uniforms`, a handful of vectorised operations), elsewhere as
        tensor operations on the device. Both give the same numbers bit for bit."""
        if positions.device.type == "cpu" and not self.in_capture:
            return torch.from_numpy(_host_uniforms(self.seeds.numpy(), positions.numpy(), stream))
        return uniforms(self.seeds, positions, stream)

    def top_probability(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, ..., V) draft logits -> (B, ...) the probability of each row's most likely draft, what η
        (Kangaroo's stopping rule) compares: the softmax's on a greedy row, the processed
        distribution's on a sampled one."""
        raw = logits.float()
        if self.all_greedy:
            return raw.softmax(-1).max(-1).values
        processed = self.process(logits)
        return torch.where(_rows(self.greedy, logits), raw, processed).softmax(-1).max(-1).values


def _facts(params: Sequence[SamplingParams]) -> dict:
    """`RowSampling`'s host facts of the rows' settings."""
    greedy = [p.greedy for p in params]
    return {"all_greedy": all(greedy), "any_greedy": any(greedy),
            "filters": any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy),
            "max_top_k": max((p.top_k for p in params), default=0)}


def _rows(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row (B,) tensor (or a scalar) shaped to broadcast against `like` (B, ..., V)."""
    return x.reshape(x.shape + (1,) * (like.dim() - x.dim()))


# -- counter-based random numbers ------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split in 16-bit halves so int64 never overflows."""
    high = (((x >> 16) * c) & 0xFFFF) << 16
    return (high + (x & 0xFFFF) * c) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32"), on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform numbers in [0, 1) (float64, 32 random bits) keyed by (row seed, position, stream).

    seeds: (B,) int64, one per row; positions: (B, T) int64 positions of the tokens being decided;
    stream: DRAFT, ACCEPT or TARGET. Same key, same number; any key change gives an unrelated one.
    Tensor operations on the device (a captured pass keeps them); `RowSampling.uniforms` takes the
    host's faster way where it can.
    """
    seeds = seeds.to(torch.int64)[:, None]
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32) ^ 0x85EBCA6B)
    h = _mix32(h ^ (positions.to(torch.int64) & _MASK32))
    h = _mix32(h ^ (0xC2B2AE35 + stream))
    return h.double() * 2.0**-32


def _host_mix32(x: np.ndarray) -> np.ndarray:
    """`_mix32` on uint32 arrays, whose products wrap mod 2^32 by themselves."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _host_uniforms(seeds: np.ndarray, positions: np.ndarray, stream: int) -> np.ndarray:
    """`uniforms` in numpy: seeds (B,) and positions (B, T) int64 -> (B, T) float64, the same bits."""
    seeds = seeds.astype(np.int64)[:, None]
    low = (seeds & _MASK32).astype(np.uint32)
    high = ((seeds >> 32) & _MASK32).astype(np.uint32)
    h = _host_mix32(low ^ np.uint32(0x9E3779B9))
    h = _host_mix32(h ^ high ^ np.uint32(0x85EBCA6B))
    h = _host_mix32(h ^ (positions.astype(np.int64) & _MASK32).astype(np.uint32))
    h = _host_mix32(h ^ np.uint32((0xC2B2AE35 + stream) & _MASK32))
    return h.astype(np.float64) * 2.0**-32


# The race's per-token key: mixed into the draw's number, it gives each token its own uniform
_TOKEN_KEY = 0x27D4EB2F


def token_keys(vocab: int, device) -> torch.Tensor:
    """(V,) int64: `_mix32` of each token id with `_TOKEN_KEY`. Made anew each call: a captured pass
    replays the operations it ran at capture, so a cache would change them."""
    return _mix32(torch.arange(vocab, device=device) ^ _TOKEN_KEY)


@functools.lru_cache(maxsize=8)
def _host_token_keys(vocab: int) -> np.ndarray:
    """`token_keys` in numpy: (V,) uint32."""
    return _host_mix32(np.arange(vocab, dtype=np.uint32) ^ np.uint32(_TOKEN_KEY))


def _race_bits(u: torch.Tensor) -> torch.Tensor:
    """(...) uniforms -> (...) int64: their 32 bits (u is h / 2^32; u = 1 gives 0, as the C++ `draw`)."""
    return (u.double() * 2.0**32).to(torch.int64) & _MASK32


def race_numbers(u: torch.Tensor, vocab: int) -> torch.Tensor:
    """(...) uniforms -> (..., V) int64: each token's 32 random bits for the race, mix32(u's bits ^ key_v),
    as tensor operations on u's device (`_host_race` makes the same bits in numpy)."""
    return _mix32(_race_bits(u)[..., None] ^ token_keys(vocab, u.device))


def _host_race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` on CPU tensors in numpy, the same winner for less work: a token takes a logarithm only if
    it can still win. Since -ln x >= 1 - x, a token's score p / -ln u is at most p / (1 - u); one whose
    bound falls below the score of its row's likeliest token cannot win (nor can a zero-probability one)."""
    vocab = probs.shape[-1]
    held = probs.detach().reshape(-1, vocab)  # (N, V)
    held = (held if held.dtype in (torch.float32, torch.float64) else held.float()).numpy()
    bits = _race_bits(u).reshape(-1).numpy().astype(np.uint32)  # (N,)
    uniform = (_host_mix32(bits[:, None] ^ _host_token_keys(vocab)) + 0.5) * 2.0**-32  # (N, V) float64
    rows = np.arange(held.shape[0])
    top = held.argmax(-1)  # (N,) each row's likeliest token: its score is a floor under the winner's
    floor = held[rows, top].astype(np.float64) / -np.log(uniform[rows, top])
    live = np.flatnonzero(held > floor[:, None] * (1.0 - uniform))  # the few that may beat it
    scores = np.full(held.shape, -1.0)
    scores.flat[live] = held.flat[live] / -np.log(uniform.flat[live])
    scores[rows, top] = floor
    return torch.from_numpy(scores.argmax(-1)).reshape(probs.shape[:-1])


def sample(probs: torch.Tensor, u: torch.Tensor, on_host: bool = False) -> torch.Tensor:
    """An exponential race (the Gumbel-max trick): (..., V) probabilities (need not sum to 1) and (...)
    uniforms -> (...) ids, argmax_v p_v / e_v with e_v = -ln u_v, each token's own uniform
    u_v = (`race_numbers` + 1/2) / 2^32. Token v wins with probability p_v / Σ p; never a
    zero-probability token; no sort and no cumulative sum.

    Why a race rather than the inverse CDF: two distributions raced with the same u give the same token
    with probability close to their overlap Σ min(p, q) (the inverse CDF's agreement is far lower), so
    a draft distribution raced with the target's number at a position guesses the target's draw there
    (`greedy_rounds`' overlapped sampled rounds). `on_host`: CPU tensors outside a captured pass (which
    may not read the host) race in numpy (`_host_race`), the same winner.
    """
    if on_host and probs.device.type == "cpu":
        return _host_race(probs, u)
    e = -torch.log((race_numbers(u, probs.shape[-1]).double() + 0.5) * 2.0**-32)  # (..., V) > 0
    score = torch.where(probs > 0, probs.double() / e, -1.0)
    return score.argmax(-1)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) normalised over the vocabulary; p itself where that is all zero (p ≤ q everywhere)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p)


# -- the accept/reject rule ------------------------------------------------------------------------
def copied_probs(copied: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft distribution q of copied drafts (B, m): one-hot (B, m, V), since a copy is a
    deterministic function of the context. With it `accept_sampled` accepts a copied token x with
    probability p(x) and on rejection draws from p with x removed, renormalised."""
    return F.one_hot(copied, vocab_size).float()


def sure_drafts(tops: torch.Tensor, stop_below: float) -> int:
    """η's rule (Kangaroo's; `DecodeSettings.stop_below`): how many of a round's drafts come before the
    first draft step at which no row's draft distribution puts η on its most likely token; tops (k, B)
    each step's top draft probability per row. All k where η is 0. One host read. It reads only the
    drafts, so the output stays the target's."""
    if not stop_below or not tops.shape[0]:
        return int(tops.shape[0])
    # "not below η" rather than "at least η": a NaN top counts as sure, as in the C++ rounds (`sure`)
    return int((~(tops < stop_below)).any(1).cpu().int().cumprod(0).sum())


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, the same ids. bf16/fp16 logits on CPU are widened to fp32 first (exactly,
    so ties and NaNs pick the same index): torch's CPU argmax over a low-precision dtype is slower
    than the widening and an fp32 argmax together (docs/performance.md)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification: accept drafts while they equal the target's argmax.

    drafts: (B, k); target_logits: (B, k+1, V), position i predicting the token after draft i
    (position 0: after the pending token). Returns (tokens (B, k+1), accepted (B,)): a row emits
    tokens[:accepted + 1], its accepted drafts (equal to the argmax) then the target's own token.
    """
    tokens = greedy_tokens(target_logits)  # (B, k+1)
    matches = drafts == tokens[:, :-1]  # (B, k)
    accepted = matches.int().cumprod(1).sum(1)  # length of the leading run of matches
    return tokens, accepted


def accept_sampled(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                   u_accept: torch.Tensor, u_target: torch.Tensor, live: int | None = None,
                   on_host: bool = False):
    """Speculative sampling: accept draft i with probability min(1, p_i(d)/q_i(d)).

    drafts: (B, k) drawn from q (B, k, V); p: (B, k+1, V) target probabilities; u_accept (B, k) and
    u_target (B, k+1) uniforms. The first rejected position is replaced by a draw from the residual
    max(0, p − q) normalised; after k acceptances the bonus token is drawn from p_k. Returns
    (tokens (B, k+1), accepted (B,)) like `accept_greedy`. live: the drafts' columns that hold drafts
    (None: all k), the rest padding of a fixed-shape pass: never accepted, and the column after the
    last live one draws the bonus from p itself, so the decisions are those of the live drafts alone.
    on_host: the draw's, `sample`'s.
    """
    k = drafts.shape[1]
    columns = torch.arange(k + 1, device=drafts.device)
    real = columns < (k if live is None else live)  # (k+1,): the columns of real drafts
    p_draft = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # (B, k)
    q_draft = q.gather(-1, drafts[..., None])[..., 0]  # (B, k), > 0: d was drawn from q
    # u < p/q, without dividing
    accepted = ((u_accept * q_draft < p_draft) & real[:k]).int().cumprod(1).sum(1)
    # What the target emits at the column where the round stops (`accepted`): the residual after a
    # rejection at a draft's column, the bonus from p past the drafts; drawn at that column alone
    at = accepted[:, None, None].expand(-1, 1, p.shape[-1])  # (B, 1, V)
    p_at = p.gather(1, at)[:, 0]  # (B, V)
    q_at = F.pad(q, (0, 0, 0, 1)).gather(1, at)[:, 0]  # (B, V), zeros past the drafts
    fallback = torch.where(real[accepted][:, None], residual_probs(p_at, q_at), p_at)
    correction = sample(fallback, u_target.gather(1, accepted[:, None])[:, 0], on_host)  # (B,)
    keep_draft = columns < accepted[:, None]
    tokens = torch.where(keep_draft, F.pad(drafts, (0, 1)), correction[:, None])
    return tokens, accepted


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits (..., V) with every token `mask` (..., V, bool) disallows at -inf (a grammar's). A row
    whose logits keep no allowed finite value (a trimmed draft head outside the mask) becomes uniform
    over the mask, so a draft is always one the grammar allows."""
    if mask.device != logits.device:  # a host mask (the grammar's); a captured pass's is on the device
        mask = mask.to(logits.device)
    masked = logits.masked_fill(~mask, float("-inf"))
    empty = ~torch.isfinite(masked).any(-1, keepdim=True)  # no host read: a where on every call
    return torch.where(empty & mask, torch.zeros((), dtype=logits.dtype, device=logits.device), masked)
