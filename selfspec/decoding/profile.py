"""Where a decoding round's time goes: seconds per part of the round, on the host's clock.

A round is its passes (the early exit's draft passes, the verification pass) and the work between
them. At a small model's step (a fraction of a millisecond on a CPU, a few milliseconds on a GPU)
that work, Python and small tensors, can cost as much as the passes; this profile says how much.
`SelfSpecGenerator.generate(profile=True)` fills `GenerationStats.profile`; `selfspec eval roofline`
prints it beside the passes' own times.

The parts, in the order a round meets them:

- policy: the plan (k, copies looked up), the controller's update and the copy index's observation;
- draft passes: blocks [0, E) + the draft head per early-exit draft (the model's work);
- draft choice: between the draft passes: η, the pick (argmax or sample), assembling the drafts;
- grammar: llguidance (masks, forced tokens, admitting drafts, verification masks, commit);
- verification pass: the drafts' tail through [0, E), blocks [E, N) and the LM head on k + 1
  positions (a plain step's whole-model pass lands here too);
- acceptance: the accepted prefix (greedy or rejection sampling) and the round's one host read;
- rollback: the cache rolled back to what was kept, finished rows dropped, the small device copies;
- statistics: `GenerationStats` and its per-source counts;
- other: the rest of the loop (emit counts, eos, output buffers, stop strings, the streamer).

Laps read `time.perf_counter()`: on a CPU a pass runs synchronously, so its lap is its time. On a
GPU the host runs ahead of the device and waits at the round's host read, so the device's time
lands in "acceptance" and the other parts are the host's own cost (kernel launches, Python): the
overhead a captured round (CUDA graphs) removes.
"""

from __future__ import annotations

import time

PARTS = ("policy", "draft passes", "draft choice", "grammar", "verification pass", "acceptance", "rollback",
         "statistics", "other")
PASSES = ("draft passes", "verification pass")  # the model's own work; the rest is per-round overhead


class RoundProfile:
    """Seconds per part (`PARTS`), summed over rounds. `lap(part)` charges the time since the previous
    lap (or `start()`) to `part`."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now

    def split(self, seconds: dict, rest: str) -> None:
        """Charge the time since the previous lap to several parts: `seconds` {part: s} as a compiled
        call's own clock measured them inside it, the remainder to `rest`."""
        now = time.perf_counter()
        for part, value in seconds.items():
            self.seconds[part] += value
        self.seconds[rest] += now - self._last - sum(seconds.values())
        self._last = now


def overhead(seconds: dict) -> float:
    """Seconds outside the model's passes (every part but `PASSES`)."""
    return sum(value for part, value in seconds.items() if part not in PASSES)


__all__ = ["PARTS", "PASSES", "RoundProfile", "overhead"]
