"""Speedups measured side by side: paired ratios and a distribution-free interval for their median.

A method and plain decoding timed in the same repeat (interleaved) saw the same machine; the ratio of
their rates in that repeat is one paired speedup, and a shared machine's drift cancels in it. Over
repeats, the median of the paired speedups and an interval for it say whether a method beats plain
decoding by more than the noise (`beats_plain`): the sweep stores a setting only then, and the
benchmark prints each method's interval.
"""

from __future__ import annotations

import math
import statistics

CONFIDENCE = 0.9  # of the interval the write-back's "beats plain" is judged by


def median_interval(ratios, confidence: float = CONFIDENCE) -> dict:
    """The median of paired speedups and a distribution-free interval for it: the j-th smallest and
    j-th largest ratio, j the largest whose coverage 1 − 2·P(Binomial(n, ½) < j) is at least
    `confidence` (n = 5 gives the min and max, 94%); with too few ratios for that, the min and max
    and their lower coverage (n = 3: 75%). Returns speedup, low, high, coverage, spread ([min, max])."""
    ratios = sorted(ratios)
    n = len(ratios)
    if not n:
        return {"speedup": float("nan"), "low": float("nan"), "high": float("nan"), "coverage": 0.0,
                "spread": [float("nan"), float("nan")]}

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    j = max([j for j in range(1, (n + 1) // 2 + 1) if coverage(j) >= confidence], default=1)
    return {"speedup": statistics.median(ratios), "low": ratios[j - 1], "high": ratios[n - j],
            "coverage": coverage(j), "spread": [ratios[0], ratios[-1]]}


def paired_speedups(rates: list[float], plain_rates: list[float]) -> list[float]:
    """A cell's speedup in each repeat: its tokens/s ÷ plain decoding's in the same repeat (both saw
    the same machine state, interleaved)."""
    return [rate / plain for rate, plain in zip(rates, plain_rates)]


def beats_plain(entry: dict | None) -> bool:
    """Whether a re-timed cell beats plain decoding by more than the noise: its interval's lower end
    is above 1."""
    return entry is not None and entry.get("low", float("nan")) > 1.0


__all__ = ["CONFIDENCE", "beats_plain", "median_interval", "paired_speedups"]
