"""`Lanes`: the stepped decode of `SelfSpecGenerator.engine`, its greedy rows and its sampled rows in two
batches of their own.

A round runs one k for all its rows (`runner.py`), and a batch with any sampled row takes speculative
sampling's rule for every row. Sharing one batch costs the greedy rows their fast path (the compiled
greedy verification, and the cost gate, which leaves a batch with a sampled row alone) and couples the
rows' drafts (copy lengths follow the batch's acceptance), so a seeded sampled row's text would depend on
its batch-mates. Each kind of row therefore runs in a lane of its own, an `Engine` made by `make`
on its first row: the greedy lane at the call's settings, the sampled lane at the settings a sampled call
would decode at alone (the checkpoint's sampled pick, `SelfSpecGenerator.engine`). A step is one step of
each lane that has rows, and a mixed batch costs what its two halves cost apart.

Rows keep the caller's numbering (the order of `add`) across lanes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ..errors import UserError
from ..sampling import SamplingParams
from .engine import Engine
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundOutput


class Lanes:
    """A decode the caller steps, as `Engine` (`add`, `step`, `cancel`, `text`, `done`, `output`, `start`),
    its rows in two lanes by their sampling (module docstring). make(sampled, sampling): a lane's
    `Engine`, given the sampling of its first row; sampling: that of rows that bring none."""

    def __init__(self, make: Callable[[bool, SamplingParams], Engine], sampling: SamplingParams):
        self.make, self.sampling = make, sampling
        self.lanes: dict[bool, Engine] = {}  # sampled? -> its lane, made on its first row
        self.where: list[tuple[bool, int]] = []  # caller row -> (its lane, its row there)
        self.callers: dict[bool, list[int]] = {False: [], True: []}  # a lane's rows -> caller rows
        self.wall = time.perf_counter()

    def lane(self, sampled: bool) -> Engine | None:
        """The lane of greedy (False) or sampled (True) rows; None before its first row."""
        return self.lanes.get(sampled)

    def add(self, request: NewRow) -> int:
        """Queue a request in its lane; returns its row (the order of `add`)."""
        sampled = not (request.sampling or self.sampling).greedy
        new = sampled not in self.lanes
        lane = self.make(sampled, request.sampling or self.sampling) if new else self.lanes[sampled]
        at = lane.add(request)  # a refused request raises here, before a new lane is kept
        if new:
            self.lanes[sampled] = lane
        self.where.append((sampled, at))
        self.callers[sampled].append(len(self.where) - 1)
        return len(self.where) - 1

    def start(self) -> None:
        """Prefill the rows added so far, each lane's together."""
        if not self.lanes:
            raise UserError("an engine starts with at least one request: add one first")
        for lane in self.lanes.values():
            if lane.b is None:
                lane.start()

    @property
    def done(self) -> bool:
        """No row runs and none waits to join, in either lane."""
        return bool(self.lanes) and all(lane.done for lane in self.lanes.values())

    def step(self) -> list[RoundOutput]:
        """One step of each lane with rows (`Engine.step`): what each running row emitted, rows numbered
        as the caller added them."""
        if not self.lanes:
            raise UserError("an engine starts with at least one request: add one first")
        outputs = []
        for sampled, lane in self.lanes.items():
            if not lane.done:
                callers = self.callers[sampled]
                outputs += [dataclasses.replace(out, row=callers[out.row]) for out in lane.step()]
        return outputs

    def cancel(self, row: int) -> None:
        """End `row` before its lane's next round (`Engine.cancel`)."""
        sampled, at = self.where[row]
        self.lanes[sampled].cancel(at)

    def text(self, row: int) -> str:
        """`row`'s text so far (`Engine.text`)."""
        sampled, at = self.where[row]
        return self.lanes[sampled].text(at)

    def output(self) -> GenerationOutput:
        """Every row's tokens in the caller's order and the lanes' statistics together, as `generate`
        returns them."""
        outs = {sampled: lane.output() for sampled, lane in self.lanes.items()}
        if len(outs) == 1:  # one lane: its rows are the caller's
            return next(iter(outs.values()))
        stats = GenerationStats()
        for out in outs.values():
            stats.merge(out.stats)
        stats.exit_layer = outs[False].stats.exit_layer  # where both ran, the greedy lane's
        stats.total_time = time.perf_counter() - self.wall

        def column(name: str, absent=None):  # a per-row field of the lanes' outputs, in the caller's order
            values = {sampled: getattr(out, name) for sampled, out in outs.items()}
            if all(v is None for v in values.values()):
                return None
            return [absent if values[s] is None else values[s][at] for s, at in self.where]

        return GenerationOutput(column("sequences"), stats, column("texts"), column("complete", True),
                                column("finish_reasons"))


__all__ = ["Lanes"]
