"""What a round costs at a context length, and the gate that keeps drafting only where it pays.

A round of k drafts costs k draft steps and one verification of k + 1 positions; a plain step costs
one pass of one position. All three grow with the context (each pass's attention reads the whole
cache), and not alike: the verification's attention does k + 1 queries' work, so on a compute-bound
machine a long context makes it cost more plain steps than a short one does (docs/performance.md,
"Long contexts"). Acceptance alone cannot see that; the costs can.

`RoundCosts` holds them relative to a plain step at the same length, measured at a few lengths
(`evaluation.context_costs.measure_round_costs`, which `selfspec eval sweep` runs and stores in
selfspec.json under `round_costs`): c(L), one early-exit draft step, and s(L), what each drafted
position adds to a verification (a verification of k drafts costs 1 + k·s(L) plain steps). Between the
measured lengths they are interpolated, past the last extrapolated along the last segment.

`CostGate` picks each round's k from them (Leviathan et al.'s expected speedup): among 0..k (k the
controller's, or the copy length), the k that maximises E(k, α) / R(k), with α the drafts' own
acceptance so far (per source: early exit, copies) and R(k) the round's cost: measured per k where the
costs hold whole rounds (`RoundCosts.rounds`; copies: `copy_rounds`), else k·c + 1 + k·s (c = 0 for
copies). k = 0 is a plain
step: a row whose drafts stop paying decodes plainly, and a source that drafted nothing for
`probe_every` rounds drafts again once, so α stays current and drafting returns where it pays again.
The gate reads the stored costs and accepted counts only, never clocks: the same prompts decode in the
same rounds on any machine.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import UserError
from ..metrics import expected_tokens
from .controller import AcceptanceWindow


@dataclass(frozen=True)
class RoundCosts:
    """Round costs relative to a plain step at the same context length, measured at `lengths`.

    draft[i]: one early-exit draft step at `exit_layer` (with its V' head) at lengths[i], in plain steps;
    verify_slope[i]: what each drafted position adds to a verification there (a verification of k
    drafts costs 1 + k·verify_slope plain steps); overlap_gain[i]: the early exit's speed with its
    rounds overlapped over its speed without (`DecodeSettings.overlap`; empty: not measured);
    rounds[i][j - 1]: a whole early-exit round of j drafts there (its draft loop and verification), j =
    1..K (empty: not measured); copy_rounds[i][n]: a round of copy_lengths[n] copies there (the copies'
    lookup and their verification: j + 1 positions through every block; empty: not measured). A round
    is not k draft steps and a verification that each grow by the same amount a draft: its draft loop
    runs blocks [0, E) once more than it drafts and each call has its setup, and the verification's cost
    steps with the kernels' tiles of queries, so k·c + 1 + k·s, measured at one k, prices the other k
    wrong, near the α where the gate changes its mind (figures: docs/performance.md, "The cost gate"):
    where measured, the gate prices each k by its own round. Copies' positions run every block, not
    blocks [E, N) as drafted ones do, so the early exit's s prices a copy far too cheap (copies then ran
    below plain at long contexts): they have rounds of their own.
    """

    lengths: tuple[int, ...]
    draft: tuple[float, ...]
    verify_slope: tuple[float, ...]
    exit_layer: int
    draft_vocab_size: int = 0
    overlap_gain: tuple[float, ...] = ()
    rounds: tuple[tuple[float, ...], ...] = ()
    copy_lengths: tuple[int, ...] = ()
    copy_rounds: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        n = len(self.lengths)
        if n == 0 or len(self.draft) != n or len(self.verify_slope) != n:
            raise UserError("round_costs: lengths, draft and verify_slope must be non-empty and equally long")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise UserError(f"round_costs: lengths must be increasing, got {list(self.lengths)}")
        if self.overlap_gain and len(self.overlap_gain) != n:
            raise UserError("round_costs: overlap_gain must give a value for every length, or none")
        if self.rounds and (len(self.rounds) != n or {len(r) for r in self.rounds} == {0}
                            or len({len(r) for r in self.rounds}) != 1 or min(map(min, self.rounds)) <= 0):
            raise UserError("round_costs: rounds must give every length the same number of positive round "
                            "costs (one a draft count), or none")
        lengths_ok = list(self.copy_lengths) == sorted(set(self.copy_lengths)) and min(self.copy_lengths,
                                                                                        default=1) >= 1
        values = [x for r in self.copy_rounds for x in r]
        rounds_ok = not self.copy_rounds or (
            len(self.copy_rounds) == n and {len(r) for r in self.copy_rounds} == {len(self.copy_lengths)}
            and all(math.isfinite(x) and x > 0 for x in values))
        if bool(self.copy_lengths) != bool(self.copy_rounds) or not lengths_ok or not rounds_ok:
            raise UserError("round_costs: copy_rounds must give every length a positive round cost for each "
                            "of the increasing copy_lengths, or neither be given")

    def _interpolate(self, series, length: int) -> float:
        """`series` (one value a length) at `length`: linear between the measured lengths, along the
        nearest segment beyond them (never below 0). Plain Python: the gate asks once a round or a
        compiled call, for a few values of a few points, where array calls cost more than the arithmetic."""
        lengths = self.lengths
        if len(lengths) == 1:
            return float(series[0])
        i = min(max(bisect.bisect_left(lengths, length) - 1, 0), len(lengths) - 2)
        slope = (series[i + 1] - series[i]) / (lengths[i + 1] - lengths[i])
        return max(0.0, float(series[i] + slope * (length - lengths[i])))

    def at(self, length: int) -> tuple[float, float]:
        """(c, s) at a context of `length` tokens (`_interpolate`)."""
        return self._interpolate(self.draft, length), self._interpolate(self.verify_slope, length)

    def overlap_pays(self, length: int) -> bool:
        """Whether overlapped rounds were measured faster at `length` (True where not measured): a long
        context's passes share the memory's bandwidth, and two single-threaded passes side by side can
        then run slower than one after the other on every thread."""
        return not self.overlap_gain or self._interpolate(self.overlap_gain, length) >= 1.0

    def round_costs(self, k_max: int, length: int, drafted: bool = True) -> list[float]:
        """Rounds of 0..k_max drafts at `length`, in plain steps (0 drafts: a plain step, 1); drafted=False:
        copies. Past the measured rounds (`rounds`): the last measured one's, then a draft step and a
        verified position more a draft. Copies: by `copy_rounds` where measured (linear between the
        measured copy lengths, along the last segment past them), else 1 + k·s."""
        if not drafted and self.copy_rounds:
            return [1.0] + self._copy_rounds(k_max, length)
        c, s = self.at(length)
        step = (c if drafted else 0.0) + s
        measured = min(len(self.rounds[0]) if self.rounds and drafted else 0, k_max)
        # a round verifies at least the plain step's position: never below one (extrapolated past the
        # measured lengths, a falling segment could reach 0)
        costs = [1.0] + [max(1.0, self._interpolate([r[j] for r in self.rounds], length))
                         for j in range(measured)]
        return costs + [costs[-1] + step * j for j in range(1, k_max - measured + 1)]

    def _copy_rounds(self, k_max: int, length: int) -> list[float]:
        """Rounds of 1..k_max copies at `length`: `copy_rounds` interpolated in the length, then linearly in
        the copy count between the measured counts, from 0 copies (a plain step, 1) on, and along the last
        segment past them. A copy more never costs less (a running maximum over the counts: measured rounds
        carry noise, and a falling segment would price long copies as free)."""
        counts, at = (0, *self.copy_lengths), [1.0]
        for n in range(len(self.copy_lengths)):
            at.append(max(at[-1], self._interpolate([r[n] for r in self.copy_rounds], length)))
        costs = []
        for j in range(1, k_max + 1):
            i = min(bisect.bisect_left(counts, j) - 1, len(counts) - 2)
            costs.append(at[i] + (at[i + 1] - at[i]) / (counts[i + 1] - counts[i]) * (j - counts[i]))
        return costs

    def applies_to(self, exit_layer: int, draft_vocab_size: int) -> bool:
        """Whether the draft costs were measured for this early exit (the verification's hold for any)."""
        return (exit_layer, draft_vocab_size) == (self.exit_layer, self.draft_vocab_size)

    def to_json(self) -> dict:
        return {"lengths": list(self.lengths), "draft": [round(x, 4) for x in self.draft],
                "verify_slope": [round(x, 4) for x in self.verify_slope], "exit_layer": self.exit_layer,
                "draft_vocab_size": self.draft_vocab_size,
                **({"overlap_gain": [round(x, 4) for x in self.overlap_gain]} if self.overlap_gain else {}),
                **({"rounds": [[round(x, 4) for x in r] for r in self.rounds]} if self.rounds else {}),
                **({"copy_lengths": list(self.copy_lengths),
                    "copy_rounds": [[round(x, 4) for x in r] for r in self.copy_rounds]}
                   if self.copy_rounds else {})}

    @classmethod
    def from_json(cls, entry: dict) -> RoundCosts:
        for key in ("copy_lengths", "copy_rounds"):
            if not isinstance(entry.get(key, []), list) or (
                    key == "copy_rounds" and not all(isinstance(r, list) for r in entry.get(key, []))):
                raise UserError(f"round_costs in selfspec.json is malformed ({key} must be a list"
                                f"{' of lists' if key == 'copy_rounds' else ''}); rerun selfspec eval sweep "
                                f"--write-back")
        if any(int(x) != x for x in entry.get("copy_lengths", []) if isinstance(x, (int, float))):
            raise UserError("round_costs in selfspec.json is malformed (copy_lengths must be whole numbers); "
                            "rerun selfspec eval sweep --write-back")
        try:
            return cls(tuple(int(x) for x in entry["lengths"]), tuple(float(x) for x in entry["draft"]),
                       tuple(float(x) for x in entry["verify_slope"]), int(entry["exit_layer"]),
                       int(entry.get("draft_vocab_size", 0)),
                       tuple(float(x) for x in entry.get("overlap_gain", ())),
                       tuple(tuple(float(x) for x in r) for r in entry.get("rounds", ())),
                       tuple(int(x) for x in entry.get("copy_lengths", ())),
                       tuple(tuple(float(x) for x in r) for r in entry.get("copy_rounds", ())))
        except (KeyError, TypeError, ValueError) as error:
            raise UserError(f"round_costs in selfspec.json is malformed ({error}); rerun selfspec eval sweep "
                            f"--write-back") from None


class CostGate:
    """Each round's k from the round's costs at the batch's longest context and the drafts' acceptance.

    `k(source, k_max, length)`: the best k in 0..k_max for drafts from `source` ("early_exit": draft
    steps cost c each; "copy": no draft steps, their rounds `copy_rounds` where measured); k_max itself
    until the source has `min_tested` tested drafts, for one round after the source drafted nothing for
    `probe_every` rounds, and for the early exit when the costs were measured at another exit
    (`gates_early_exit` False: `RoundCosts.applies_to`). `rounds_to_probe()`: how many rounds a compiled
    call may run before a source it cut to no drafts is due its probe.
    `record(drafts)` takes a round's drafts per source, {source: (k, accepted counts of the rows that
    tested them)}; {} for a round that drafted nothing. A probe is offered for one round: a source that
    does not draft then (a copy finds no match) is offered the next after `probe_every` rounds more.
    """

    SOURCES = ("early_exit", "copy")

    def __init__(self, costs: RoundCosts, gates_early_exit: bool = True, window: int = 32,
                 min_tested: int = 8, probe_every: int = 16):
        self.costs, self.gates_early_exit = costs, gates_early_exit
        self.min_tested, self.probe_every = min_tested, probe_every
        self.windows = {s: AcceptanceWindow(window) for s in self.SOURCES}
        self.idle = dict.fromkeys(self.SOURCES, 0)  # rounds since the source last drafted
        self.cut = dict.fromkeys(self.SOURCES, False)  # whether the last `k` cut the source to none
        self.rounds = 0  # rounds recorded

    def alpha(self, source: str) -> float | None:
        """The source's α over its last `window` rounds, None before `min_tested` drafts were tested."""
        window = self.windows[source]
        return window.alpha() if window.tested >= self.min_tested else None

    @property
    def probing(self) -> bool:
        """Whether the next round is a probe (a source with a known α idle for `probe_every` rounds): a
        compiled call then runs that one round alone."""
        return any(self.idle[s] >= self.probe_every and self.alpha(s) is not None for s in self.SOURCES)

    def learning(self, sources) -> bool:
        """Whether the gate still learns its first α: fewer than `min_tested` rounds recorded and nothing
        of `sources` tested yet, or a source tested fewer than `min_tested` drafts (a source that has not
        drafted since, a copy that never matched, holds nothing up)."""
        tested = [self.windows[s].tested for s in sources]
        starting = not any(tested) and self.rounds < self.min_tested
        return starting or any(0 < t < self.min_tested for t in tested)

    def k(self, source: str, k_max: int, length: int) -> int:
        alpha = self.alpha(source)
        drafted = source == "early_exit"
        self.cut[source] = False
        if (k_max <= 0 or alpha is None or self.idle[source] >= self.probe_every
                or (drafted and not self.gates_early_exit)):
            return k_max
        rounds = self.costs.round_costs(k_max, length, drafted)
        rates = [expected_tokens(k, alpha) / cost for k, cost in enumerate(rounds)]
        best = rates.index(max(rates))  # the first best: the fewer drafts where two tie
        self.cut[source] = best == 0
        return best

    def rounds_to_probe(self) -> int | None:
        """Rounds until the first source the last `k` cut to no drafts is due its probe (`probe_every`
        idle rounds); None where no source was cut. A compiled call that ran past it (plain steps, or a
        hybrid's early-exit rounds while its copies are cut) would read the round after as a probe refused
        and start the idle count again: the source would draft again only where a call happened to end
        on a due probe."""
        due = [self.probe_every - self.idle[s] for s in self.SOURCES if self.cut[s]]
        return min(due) if due else None  # ≥ 1: a source `probe_every` idle rounds long is not cut

    def record(self, drafts: dict) -> None:
        self.rounds += 1
        for source in self.SOURCES:
            k, accepted = drafts.get(source, (0, ()))
            if self.windows[source].add(k, () if accepted is None else accepted):
                self.idle[source] = 0
            else:
                # a probe offered and not taken (no copy matched) waits another `probe_every` rounds:
                # a compiled call runs one round while a probe is due, and must not stay there
                self.idle[source] = 0 if self.idle[source] >= self.probe_every else self.idle[source] + 1


__all__ = ["CostGate", "RoundCosts"]
