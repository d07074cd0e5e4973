"""Acceptance statistics and the cost model of (self-)speculative decoding.

Words (the same everywhere in selfspec):

- ``num_speculations`` k: draft tokens proposed per round.
- ``acceptance_rate`` α: the probability that a draft token is accepted *given that the verifier
  tests it* (it is tested only if every earlier draft of the round was accepted). Its estimate is
  accepted / tested, where a round with a accepted out of k tests min(a + 1, k) drafts. This is the
  α of the formulas below (positions modelled as independent with the same α). Note that
  accepted / drafted, which some tools report, is smaller: it counts the drafts never tested.
- accepted length: tokens a round emits, a + 1 (the accepted drafts plus the target's own token:
  the correction after a rejection, or the bonus token after a fully accepted draft). Its mean is
  ``mean_accepted_length`` and counts that bonus/correction token, so it is directly comparable
  with E(k, α).
- ``draft_cost`` c: time of one draft step (the first E blocks + final norm + head on one token)
  divided by the time of one full forward on one token (plain decoding's step).

Two speedup formulas (both assume α independent of position and a memory-bound verifier whose
k + 1 positions cost what one position costs):

- :func:`speedup_simple` E(k)/(1 + k·c) — a round costs k draft steps plus one full forward. That is
  exactly this engine's round: k draft steps, then the last draft through the first E blocks (c)
  and the remaining blocks on k + 1 positions (1 − c), reusing the draft blocks' KV cache. It is
  also the practice article's formula.
- :func:`speedup_kv_reuse` (1 − α^{k+1}) / ((1 − α)(1 − c + k·c)) — the layer-skip article's
  "KV reuse" form: verification charged only the remaining blocks (1 − c). It leaves out the pass
  of the last draft token through the first E blocks that verification still needs, so for this
  engine it is an upper bound, above :func:`speedup_simple` by the factor (1 + k·c)/(1 − c + k·c).

Pure Python/NumPy; imports nothing from the rest of the project.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


# -- the cost model --------------------------------------------------------------------------------
def expected_tokens(k: int, alpha: float) -> float:
    """E(k, α) = 1 + α + ... + α^k = (1 − α^{k+1}) / (1 − α): expected tokens per round, bonus counted.

    k = 0 (plain decoding) gives 1; α = 1 gives k + 1 (the limit of the closed form).
    """
    if k < 0:
        raise ValueError(f"num_speculations must be >= 0, got {k}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance_rate must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup_simple(k: int, alpha: float, draft_cost: float) -> float:
    """E(k, α) / (1 + k·c): a round = k draft steps of cost c + one full forward (this engine's round)."""
    return expected_tokens(k, alpha) / (1.0 + k * draft_cost)


def speedup_kv_reuse(k: int, alpha: float, draft_cost: float) -> float:
    """(1 − α^{k+1}) / ((1 − α)(1 − c + k·c)): verification charged only the non-draft blocks (1 − c).

    The layer-skip article's form. It ignores the last draft token's pass through the draft blocks,
    which verification needs for the bonus token's distribution: an upper bound for this engine.
    """
    return expected_tokens(k, alpha) / (1.0 - draft_cost + k * draft_cost)


def speedup_measured_costs(k: int, alpha: float, draft_time: float, verify_time: float,
                           plain_time: float) -> float:
    """Speedup from measured times: E(k, α)·t_plain / (k·t_draft + t_verify(k)).

    draft_time: seconds per draft step; verify_time: seconds per verification of k drafts (the last
    draft through the draft blocks + the rest on k + 1 positions + accept); plain_time: seconds per
    plain decoding step. With k = 0 it is t_plain / t_verify(0), about 1.
    """
    return expected_tokens(k, alpha) * plain_time / (k * draft_time + verify_time)


def optimal_num_speculations(alpha: float, draft_cost: float, k_max: int = 8,
                             formula=speedup_simple) -> tuple[int, float]:
    """The k in 0..k_max with the highest `formula(k, α, c)` and that speedup (k = 0 scores 1)."""
    best = (0, 1.0)
    for k in range(1, k_max + 1):
        s = formula(k, alpha, draft_cost)
        if s > best[1]:
            best = (k, s)
    return best


def weight_draft_cost(exit_layer: int, block_params: Sequence[int], head_params: int,
                      draft_head_params: int | None = None) -> float:
    """c from the weights a step reads: (Σ blocks [0, E) + draft head) / (Σ all blocks + head).

    A decode step at batch 1 is bound by memory bandwidth, so its time follows the bytes it reads:
    the estimate before anything is timed (`selfspec eval sweep` measures the real c).
    block_params: parameters of each block; head_params: the LM head's (V·D); draft_head_params:
    the draft head's (V'·D for a trimmed head; default the whole head).
    """
    draft_head = head_params if draft_head_params is None else draft_head_params
    return (sum(block_params[:exit_layer]) + draft_head) / (sum(block_params) + head_params)


def choose_exit(acceptance: Mapping[int, float], draft_cost: Mapping[int, float], k_max: int = 8) -> dict:
    """The exit layer E and draft length k with the highest predicted speedup E(k, α)/(1 + k·c).

    acceptance: E -> α measured at that exit (e.g. held-out top-1 agreement, greedy α); draft_cost:
    E -> c. Returns {"exit_layer", "num_speculations", "predicted_speedup", "candidates": {E: {...}}};
    when no exit beats plain decoding, the best exit is still named, with k = 0 and speedup 1.
    """
    if not acceptance:
        raise ValueError("choose_exit needs at least one candidate exit")
    candidates = {}
    for layer, alpha in sorted(acceptance.items()):
        k, speedup = optimal_num_speculations(alpha, draft_cost[layer], k_max)
        candidates[layer] = {"acceptance_rate": alpha, "draft_cost": draft_cost[layer], "num_speculations": k,
                             "predicted_speedup": speedup}
    # The fastest; among equals (no exit pays: all 1.0) the one that accepts most.
    best = max(candidates,
               key=lambda e: (candidates[e]["predicted_speedup"], candidates[e]["acceptance_rate"]))
    return {"exit_layer": best, "num_speculations": candidates[best]["num_speculations"],
            "predicted_speedup": candidates[best]["predicted_speedup"], "candidates": candidates}


def predicted_speedup(k_rounds: Mapping[int, int], alpha: float, draft_cost: float,
                      verify_cost: float = 1.0) -> float:
    """Speedup of a run whose rounds used various k: Σ n_k·E(k) / Σ n_k·(k·c + v_k) (plain step = 1),
    v_k = `verify_cost` for a round with drafts (a verification, in plain steps; 1 by default, the
    articles' assumption) and 1 for a plain step (k = 0).

    k_rounds: k -> number of rounds run with that k (k = 0 rounds are plain steps).
    """
    tokens = sum(n * expected_tokens(k, alpha) for k, n in k_rounds.items())
    cost = sum(n * (k * draft_cost + (verify_cost if k else 1.0)) for k, n in k_rounds.items())
    if cost == 0:
        raise ValueError("no rounds")
    return tokens / cost


def break_even_acceptance(k_rounds: Mapping[int, int], draft_cost: float, verify_cost: float) -> float:
    """The α at which `predicted_speedup` is 1 for these rounds and costs (bisection: the speedup
    rises with α); NaN when even α = 1 does not reach plain decoding's speed (k + 1 tokens cost more
    than k + 1 plain steps) or no round drafted."""
    if not any(k for k in k_rounds) or predicted_speedup(k_rounds, 1.0, draft_cost, verify_cost) < 1.0:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if predicted_speedup(k_rounds, middle, draft_cost, verify_cost) < 1.0:
            low = middle
        else:
            high = middle
    return high


# -- acceptance statistics -------------------------------------------------------------------------
def drafts_tested(accepted: np.ndarray, k: int) -> np.ndarray:
    """Drafts the verifier tested per round: all accepted ones plus the first rejected one."""
    return np.minimum(np.asarray(accepted) + 1, k)


def round_counts(accepted, k: int) -> tuple[int, int]:
    """(accepted, tested) drafts of one round of k drafts over its rows' accepted counts (B,), in plain
    Python: a round's handful of rows costs less so than as array operations, once a round."""
    values = accepted.tolist() if hasattr(accepted, "tolist") else list(accepted)
    return sum(min(a, k) for a in values), sum(min(a + 1, k) for a in values)


def acceptance_rate(accepted: Sequence[int] | np.ndarray, k: int) -> float:
    """α̂ = accepted / tested over rounds of one k (NaN when nothing was tested, e.g. k = 0)."""
    accepted = np.asarray(accepted)
    tested = drafts_tested(accepted, k).sum() if k > 0 else 0
    return float(accepted.sum() / tested) if tested else float("nan")


@dataclass
class AcceptanceStats:
    """Running acceptance statistics over (row, round) pairs, updated once per round.

    `position_tested` and `position_accepted` count, for draft position i (0-based), how often it was
    tested and accepted, so
    `per_position_acceptance[i]` is P(draft i accepted | drafts 0..i-1 accepted): it shows whether
    later positions are accepted less often than the formulas' constant α assumes.
    """

    rounds: int = 0  # rounds run (a round serves every active row at once)
    row_rounds: int = 0  # (row, round) pairs with k >= 1
    drafted: int = 0  # draft tokens proposed to the verifier
    tested: int = 0
    accepted: int = 0
    emitted: int = 0  # accepted + 1 per (row, round) pair, before cuts at eos/limits
    k_rounds: dict = field(default_factory=dict)  # k -> rounds run with that k
    accepted_histogram: list = field(default_factory=list)  # [a] -> (row, round) pairs accepting a drafts
    position_tested: list = field(default_factory=list)
    position_accepted: list = field(default_factory=list)

    def update(self, accepted, k: int, rounds: int = 1) -> None:
        """Record one round: `accepted` holds the accepted draft count of every active row. Several
        rounds of the same k at once: `rounds` of them, `accepted` every row of every one."""
        accepted = np.asarray(accepted, dtype=np.int64)
        self.rounds += rounds
        self.k_rounds[k] = self.k_rounds.get(k, 0) + rounds
        if k == 0 or accepted.size == 0:
            return
        rows = accepted.size
        histogram = np.bincount(accepted, minlength=k + 1).tolist()  # [a] -> rows accepting a drafts
        # at_least[i]: rows that accepted >= i drafts. Draft position i is tested in those rows and
        # accepted in the rows of at_least[i + 1]. Counted in Python: k + 1 <= 9 numbers, where each
        # numpy call costs more than the sum, and this runs once or twice a round.
        at_least = [0] * (k + 2)
        for a in range(k, -1, -1):
            at_least[a] = at_least[a + 1] + histogram[a]
        for lst, n in ((self.accepted_histogram, k + 1), (self.position_tested, k),
                       (self.position_accepted, k)):
            lst.extend([0] * (n - len(lst)))
        for a in range(k + 1):
            self.accepted_histogram[a] += histogram[a]
        for i in range(k):
            self.position_tested[i] += at_least[i]
            self.position_accepted[i] += at_least[i + 1]
        self.row_rounds += rows
        self.drafted += rows * k
        accepted_drafts = sum(at_least[1:k + 1])  # Σ a
        self.tested += sum(at_least[:k])  # Σ min(a + 1, k): the accepted drafts and the first rejected
        self.accepted += accepted_drafts
        self.emitted += accepted_drafts + rows

    def merge(self, other: AcceptanceStats) -> None:
        """Add another run's counts to these (to pool several `generate` calls)."""
        for name in ("rounds", "row_rounds", "drafted", "tested", "accepted", "emitted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, n in other.k_rounds.items():
            self.k_rounds[k] = self.k_rounds.get(k, 0) + n
        for name in ("accepted_histogram", "position_tested", "position_accepted"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        """α̂ = accepted / tested (NaN before any draft was tested)."""
        return self.accepted / self.tested if self.tested else float("nan")

    @property
    def draft_efficiency(self) -> float:
        """accepted / drafted: the share of drafted tokens kept (≤ α̂)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens per speculative (row, round), bonus/correction token counted (compare with E(k, α))."""
        return self.emitted / self.row_rounds if self.row_rounds else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.position_accepted, self.position_tested)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "row_rounds": self.row_rounds, "drafted": self.drafted,
            "tested": self.tested, "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate, "draft_efficiency": self.draft_efficiency,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "accepted_histogram": list(self.accepted_histogram),
            "k_rounds": {int(k): n for k, n in sorted(self.k_rounds.items())},
        }
