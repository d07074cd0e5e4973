"""How many tokens to draft next: fixed k, the articles' window rule, or the cost model.

A controller is asked `next_k()` before every round and told the round's outcome with
`update(k, accepted, draft_time, verify_time)`: `accepted` holds the accepted draft count of every
active row, `draft_time` the seconds of the k draft steps, `verify_time` the seconds of the
verification (last draft through the draft blocks, the rest of the model on k + 1 positions, the
accept rule). k = 0 is plain decoding, and its `verify_time` is the time of one full step.

`num_speculations` in `SelfSpecGenerator.generate` picks one (`make_controller`):
an int -> `FixedK`; "auto" -> `CostModelRule`; "window" -> `WindowRule`; or pass an instance.
With a batch, k is shared by all rows and α is pooled over them.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..errors import UserError
from ..metrics import expected_tokens, round_counts


class Controller:
    """Base class: the draft length for the next round, from what past rounds showed."""

    k_max: int = 8  # the largest k this controller may ask for (sizes the KV cache's headroom)

    def next_k(self) -> int:
        raise NotImplementedError

    def update(self, k: int, accepted, draft_time: float, verify_time: float) -> None:
        """Record a finished round (default: nothing to learn)."""


class FixedK(Controller):
    """The same k every round (k = 0: plain decoding)."""

    def __init__(self, k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise UserError(f"num_speculations must be an int >= 0, 'auto' or 'window', got {k!r}")
        self.k = self.k_max = k

    def next_k(self) -> int:
        return self.k


class AcceptanceWindow:
    """α over the last `size` rounds: accepted / tested drafts, pooled over rows."""

    def __init__(self, size: int):
        self.rounds: deque = deque(maxlen=size)  # (accepted, tested) per round
        # their sums, kept as rounds come and go: α is read after every round (a compiled call's rounds
        # are shown to the policy one by one), where summing the window each time cost more than the rest
        self.accepted = self.tested = 0

    def add(self, k: int, accepted) -> bool:
        """A round of k drafts and its rows' accepted counts (B,); whether it tested any (k > 0, B > 0)."""
        if k <= 0 or not len(accepted):
            return False
        if self.rounds.maxlen and len(self.rounds) == self.rounds.maxlen:  # the oldest round leaves
            gone, gone_tested = self.rounds[0]
            self.accepted -= gone
            self.tested -= gone_tested
        counts = round_counts(accepted, k)
        self.rounds.append(counts)
        self.accepted += counts[0]
        self.tested += counts[1]
        return True

    def alpha(self, prior: float = 0.0, prior_weight: float = 0.0) -> float | None:
        """Pooled α, shrunk towards `prior` by `prior_weight` pseudo-tests; None with no data and no prior."""
        tested = self.tested + prior_weight
        return (self.accepted + prior * prior_weight) / tested if tested else None


class WindowRule(Controller):
    """The reference articles' rule, run like congestion control.

    After every round, α over the last `window` rounds (64): above `raise_above` (0.85) -> k + 1,
    below `lower_below` (0.7) -> k − 1, otherwise unchanged; k stays within [k_min, k_max] = [2, 8].
    """

    def __init__(self, k: int = 4, window: int = 64, raise_above: float = 0.85, lower_below: float = 0.7,
                 k_min: int = 2, k_max: int = 8):
        if not 1 <= k_min <= k <= k_max:
            raise UserError(f"need 1 <= k_min <= k <= k_max, got k_min={k_min}, k={k}, k_max={k_max}")
        self.k, self.k_min, self.k_max = k, k_min, k_max
        self.raise_above, self.lower_below = raise_above, lower_below
        self.window = AcceptanceWindow(window)

    def next_k(self) -> int:
        return self.k

    def update(self, k, accepted, draft_time, verify_time):
        self.window.add(k, accepted)
        alpha = self.window.alpha()
        if alpha is None:
            return
        if alpha > self.raise_above:
            self.k = min(self.k + 1, self.k_max)
        elif alpha < self.lower_below:
            self.k = max(self.k - 1, self.k_min)


class CostModelRule(Controller):
    """Pick the k that maximises expected tokens per second, E(k, α) / (k·t_draft + t_verify(k)).

    - α: pooled over the last `window` rounds, shrunk towards `prior_alpha` by `prior_weight`
      pseudo-tests so that one unlucky first round does not switch speculation off.
    - t_draft: seconds per draft step, an exponential moving average (weight `smoothing`); it grows
      with the context, since the draft blocks' attention reads the whole cache.
    - t_verify(k): moving averages per k measured so far; for other k a least-squares line through
      them, or the nearest measured one when only one k was seen (a memory-bound verifier costs
      about the same for any small k). t_verify(0) is the plain step.
    - k = 0 (plain decoding, 1 / t_verify(0)) wins when no k > 0 beats it: speculation is off.
      Every `probe_every` plain rounds one round drafts again with the best k > 0, so α and the
      timings stay current and speculation comes back when it pays again.
    """

    def __init__(self, k_initial: int = 3, k_max: int = 8, window: int = 64, smoothing: float = 0.3,
                 prior_alpha: float = 0.5, prior_weight: float = 2.0, probe_every: int = 16):
        if not 1 <= k_initial <= k_max:
            raise UserError(f"need 1 <= k_initial <= k_max, got {k_initial}, {k_max}")
        self.k_initial, self.k_max = k_initial, k_max
        self.smoothing, self.prior_alpha, self.prior_weight = smoothing, prior_alpha, prior_weight
        self.probe_every = probe_every
        self.window = AcceptanceWindow(window)
        self.draft_time: float | None = None  # seconds per draft step
        self.verify_times: dict[int, float] = {}  # k -> seconds per verification
        self.plain_rounds = 0  # consecutive rounds with k = 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def update(self, k, accepted, draft_time, verify_time):
        self.window.add(k, accepted)
        self.verify_times[k] = self._average(self.verify_times.get(k), verify_time)
        if k > 0:
            self.draft_time = self._average(self.draft_time, draft_time / k)
        self.plain_rounds = self.plain_rounds + 1 if k == 0 else 0

    def verify_time(self, k: int) -> float:
        """Estimated seconds of a verification of k drafts (see the class docstring)."""
        if k in self.verify_times:
            return self.verify_times[k]
        ks = np.array(sorted(self.verify_times), dtype=float)
        times = np.array([self.verify_times[int(j)] for j in ks])
        if len(ks) == 1:
            return float(times[0])
        slope, intercept = np.polyfit(ks, times, 1)
        return float(max(intercept + slope * k, times.min() * 0.5))

    def rates(self) -> dict[int, float]:
        """Estimated tokens per second for every k in 0..k_max (needs one measured round)."""
        alpha = self.window.alpha(self.prior_alpha, self.prior_weight)
        rates = {0: 1.0 / self.verify_time(0)}
        for k in range(1, self.k_max + 1):
            rates[k] = expected_tokens(k, alpha) / (k * self.draft_time + self.verify_time(k))
        return rates

    def next_k(self) -> int:
        if self.draft_time is None:  # nothing measured yet: draft with the initial guess
            return self.k_initial
        rates = self.rates()
        best = max(rates, key=rates.get)
        if best == 0 and self.probe_every and self.plain_rounds >= self.probe_every:
            return max((k for k in rates if k > 0), key=rates.get)  # probe: refresh α and times
        return best


def make_controller(num_speculations) -> Controller:
    """int -> FixedK, "auto" -> CostModelRule, "window" -> WindowRule, a Controller -> itself."""
    if isinstance(num_speculations, Controller):
        return num_speculations
    if num_speculations == "auto":
        return CostModelRule()
    if num_speculations == "window":
        return WindowRule()
    return FixedK(num_speculations)
