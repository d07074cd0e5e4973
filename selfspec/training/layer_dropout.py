"""Layer dropout (stochastic depth) with rates that rise with depth and over training.

Block index ``l`` (0..N-1) is skipped at training step ``t`` of ``T`` with probability

    p(l, t) = S(t) * D(l) * p_max

where ``D`` is the depth curve (:func:`depth_curve`) and ``S`` the step curve (:func:`step_curve`),
both in [0, 1]. LayerSkip's recipe is ``depth="exp"`` (0 at the first block, 1 at the last) with
``p_max`` around 0.1-0.2, so early blocks, which the draft model keeps, are rarely dropped while
late blocks, which the draft skips, learn to be skippable.

Two sampling modes (:class:`LayerDropout`):

- per-batch: one decision per block shared by every row. A dropped block is not run at all, which
  saves its compute. Under DDP/FSDP every rank must skip the same blocks, or collectives hang;
  the decisions come from a generator seeded with ``seed`` only (never the rank), so all ranks agree.
- per-sample: independent decisions per row, as in LayerSkip. The block still runs on the whole
  batch and :func:`apply_block` keeps the dropped rows' input with ``torch.where``, so no module is
  skipped (nothing to keep in step across ranks) and no compute is saved; it is a regulariser only.

This module is pure torch: it knows nothing of models; the training loop calls :func:`apply_block`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import DepthCurve, StepSchedule, check_choice
from ..cpu import to_device
from ..errors import UserError


def depth_curve(kind: str, num_layers: int) -> torch.Tensor:
    """Return D(l) for block indices l = 0..N-1, a float32 tensor of shape (N,) with values in [0, 1].

    - ``uniform``: 1 for every block.
    - ``linear``: l / (N - 1).
    - ``exp``: exp(l * ln 2 / (N - 1)) - 1 (LayerSkip), 0 at the first block and 1 at the last.

    With a single block (N == 1) every kind gives [1.0]: that block is both first and last, and
    following torchtune's ``get_scale`` a zero-length period means full scale.
    """
    check_choice("depth", kind, DepthCurve)
    if num_layers < 1:
        raise UserError(f"num_layers must be >= 1, got {num_layers}")
    if kind == "uniform" or num_layers == 1:
        return torch.ones(num_layers)
    frac = torch.arange(num_layers, dtype=torch.float64) / (num_layers - 1)  # (N,) in [0, 1]
    if kind == "linear":
        curve = frac
    else:  # exp
        curve = torch.exp(frac * math.log(2.0)) - 1.0
    # Computed in float64 so that the last block is exactly 1.0 after the cast.
    return curve.clamp(0.0, 1.0).float()


def step_curve(kind: str, step: int, total_steps: int) -> float:
    """Return S(t) in [0, 1] for training step ``step`` of ``total_steps``.

    - ``constant``: 1 (``total_steps`` is ignored).
    - ``linear``: t / T, clamped to [0, 1].
    - ``exp``: exp(t * ln 2 / T) - 1, clamped to [0, 1] (0 at t = 0, 1 at t = T).

    Non-constant kinds need ``total_steps`` > 0.
    """
    check_choice("schedule", kind, StepSchedule)
    if kind == "constant":
        return 1.0
    if total_steps <= 0:
        raise UserError(f"total_steps must be > 0 for schedule {kind!r}, got {total_steps}")
    frac = step / total_steps
    value = frac if kind == "linear" else math.exp(frac * math.log(2.0)) - 1.0
    return min(max(value, 0.0), 1.0)


def drop_probabilities(
    num_layers: int,
    p_max: float,
    depth: str,
    schedule: str,
    step: int,
    total_steps: int,
    protected_layers: int = 0,
) -> torch.Tensor:
    """Return p(l, t) = S(t) * D(l) * p_max for blocks l = 0..N-1, a float32 tensor of shape (N,).

    Blocks with index < ``protected_layers`` get probability 0: pass the exit layer E to never drop
    the draft blocks [0, E). ``p_max`` must lie in [0, 1) (1 would always drop the last block).
    """
    if not 0.0 <= p_max < 1.0:
        raise UserError(f"p_max must be in [0, 1), got {p_max}")
    if not 0 <= protected_layers <= num_layers:
        raise UserError(
            f"protected_layers must be in [0, {num_layers}] (num_layers), got {protected_layers}"
        )
    probs = depth_curve(depth, num_layers) * (step_curve(schedule, step, total_steps) * p_max)  # (N,)
    probs[:protected_layers] = 0.0
    return probs


def apply_block(
    block_fn: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    drop_rows: torch.Tensor,
) -> torch.Tensor:
    """Run ``block_fn`` on ``hidden`` (B, T, D) except for the rows where ``drop_rows`` (B,) is True.

    ``drop_rows`` is the sampler's host tensor: the decisions below are the host's, no device read.

    - all rows dropped: return ``hidden`` unchanged without calling ``block_fn`` (compute saved);
    - no row dropped: return ``block_fn(hidden)``;
    - some rows dropped: run the block on the whole batch and keep the dropped rows' input with
      ``torch.where`` (per-sample mode); the dropped rows get no gradient through the block.
    """
    if drop_rows.shape != hidden.shape[:1]:
        raise ValueError(f"drop_rows must have shape ({hidden.shape[0]},), got {tuple(drop_rows.shape)}")
    if drop_rows.device.type != "cpu":
        raise ValueError("drop_rows must be the sampler's host tensor: a device one costs a sync a test")
    if bool(drop_rows.all()):
        return hidden
    if not bool(drop_rows.any()):
        return block_fn(hidden)
    out = block_fn(hidden)  # (B, T, D)
    keep_input = to_device(drop_rows, hidden.device).view(-1, *([1] * (hidden.dim() - 1)))  # (B, 1, 1)
    return torch.where(keep_input, hidden, out)


class LayerDropout:
    """Samples which blocks to drop at each training step; owns a seeded CPU ``torch.Generator``.

    Args:
        num_layers: number of decoder blocks N.
        p_max: the largest drop probability, reached at the top block at the end of the schedule.
        depth: depth curve kind, one of ``uniform``, ``linear``, ``exp`` (see :func:`depth_curve`).
        schedule: step curve kind, one of ``constant``, ``linear``, ``exp`` (see :func:`step_curve`).
        total_steps: number of training steps T (needed by non-constant schedules).
        per_sample: True draws one decision per (block, row) as in LayerSkip; the caller runs each
            block on all rows and :func:`apply_block` keeps dropped rows with ``torch.where``, so
            nothing is skipped at the module level. False draws one decision per block shared by
            all rows; a dropped block is then not run at all.
        protected_layers: blocks [0, protected_layers) are never dropped (e.g. the exit layer E).
        seed: seed of the generator.

    Multi-process training: the per-batch decisions depend only on ``seed`` and on how many times
    :meth:`sample` has been called with ``training=True``, never on the rank, so every rank skips
    the same blocks and FSDP/DDP collectives stay matched; :meth:`synchronize` makes every rank start
    from rank 0's seed and generator state, so even a rank given another seed agrees. Every rank must call
    :meth:`sample` the same number of times (once per micro-batch). A per-batch draw consumes N
    numbers whatever the batch size, so an uneven last batch cannot desynchronise the ranks. In
    per-sample mode rows on different ranks share the same stream; pass ``seed + rank`` there if
    decorrelated rows across ranks are wanted (nothing can hang in that mode).
    """

    def __init__(
        self,
        num_layers: int,
        p_max: float,
        depth: str = "exp",
        schedule: str = "constant",
        total_steps: int = 0,
        per_sample: bool = False,
        protected_layers: int = 0,
        seed: int = 0,
    ) -> None:
        # Validate every argument now rather than at the first training step.
        drop_probabilities(num_layers, p_max, depth, schedule, 0, total_steps, protected_layers)
        self.num_layers = num_layers
        self.p_max = p_max
        self.depth = depth
        self.schedule = schedule
        self.total_steps = total_steps
        self.per_sample = per_sample
        self.protected_layers = protected_layers
        self.seed = seed
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def probabilities(self, step: int) -> torch.Tensor:
        """Return the drop probabilities p(l, step) of every block, shape (N,)."""
        return drop_probabilities(
            self.num_layers,
            self.p_max,
            self.depth,
            self.schedule,
            step,
            self.total_steps,
            self.protected_layers,
        )

    def sample(self, step: int, batch_size: int, training: bool = True) -> torch.Tensor:
        """Return a CPU bool tensor (N, B): entry [l, b] is True when block l is dropped for row b.

        In per-batch mode all columns are equal. With ``training=False`` nothing is dropped and the
        generator is not advanced, so evaluation in between steps leaves later draws unchanged.
        """
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if not training:
            return torch.zeros(self.num_layers, batch_size, dtype=torch.bool)
        probs = self.probabilities(step)  # (N,)
        if self.per_sample:
            uniform = torch.rand(self.num_layers, batch_size, generator=self.generator)  # (N, B)
            return uniform < probs[:, None]
        uniform = torch.rand(self.num_layers, generator=self.generator)  # (N,)
        return (uniform < probs)[:, None].expand(self.num_layers, batch_size).clone()  # (N, B)

    def synchronize(self) -> None:
        """Adopt rank 0's seed and generator state (one broadcast; nothing without torch.distributed).

        After this the per-batch draws are equal on every rank by construction, whatever seed each
        process was given: a machine launched with other overrides (a multi-node run starts one
        command per machine) cannot make FSDP wait for a block that another rank skipped. The
        training loop calls it once, after `prepare` (and a resume, whose state comes from rank 0's
        file anyway).
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        payload = [self.state_dict()]
        dist.broadcast_object_list(payload, src=0)
        self.load_state_dict(payload[0])

    def state_dict(self) -> dict[str, Any]:
        """Return the generator state (and seed), so that a resumed run draws the same future samples."""
        return {"seed": self.seed, "generator_state": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the generator state saved by :meth:`state_dict`."""
        self.seed = state["seed"]
        self.generator.set_state(state["generator_state"])
