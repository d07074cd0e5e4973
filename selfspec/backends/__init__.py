"""Backends: the ways one decoding algorithm runs its passes, behind one protocol (`Backend`).

The engine (`decoding/`) owns the algorithm: what a round drafts, what it verifies, what it keeps. A
backend owns how the passes of a round run on a device. Every backend offers the same operations,
and each may decline one (return None, having run nothing), in which case the engine runs that part
as torch operations through `model.DecoderView`, which are then the backend's passes too:

- `draft_loop`: a round's k early-exit drafts in one call, greedy or drawn by each row's settings, cut
  by η: the engine's own loop (`selfspec.draft_loop`), captured by the static backend, or compiled;
- `draft_step` / `exit_pass`: one greedy early-exit step (or its pass without the choice);
- `draft_choice`: a greedy draft from exit states (norm, head, grammar mask, argmax, η);
- `verify_greedy`: the verification pass, the target's argmax and the accepted prefix;
- `verify_sampled`: the verification for rows sampled by their own settings (acceptance by rejection
  sampling, with each row's random numbers);
- the capability `fused_rounds` (declared, not discovered): `greedy_rounds`, many greedy rounds of
  one row in one call, fed the proposer's state (`FusedDrafts`).

The backends:

- `reference` (`ReferenceBackend`): torch operations on any device, MKL's products on a CPU, every
  operation declined. It is the oracle every other backend is tested against, token for token.
- `cpu_kernels` (`CpuKernelsBackend`): selfspec's compiled CPU kernels (`backends/cpu_rounds`, built
  with the model's passes of `model/kernels`): each operation in one call, and fused rounds.
- `static` (`StaticBackend`): every decoding pass at fixed shapes, as written ("eager") or captured as
  CUDA graphs ("graph"); the GPU's path.

`make_backend(view, name)` picks one; "auto" is `cpu_kernels` on a CPU (each of its calls declines where
the kernels did not build), `reference` elsewhere.
"""

from __future__ import annotations

from ..errors import UserError
from ..model.view import DecoderView
from .base import STATIC_MODES, Backend, FusedDrafts
from .cpu_kernels import CpuKernelsBackend
from .reference import ReferenceBackend
from .static import StaticBackend

BACKENDS = ("reference", "cpu_kernels", "static")


def make_backend(view: DecoderView, name: str | None = None, static_mode: str | None = None) -> Backend:
    """The backend `name` ("reference", "cpu_kernels", "static"; None or "auto": "static" when a
    `static_mode` is given, else "cpu_kernels" on a CPU, else "reference") for `view`'s model, or a
    UserError naming what does not fit."""
    if name in (None, "auto"):
        name = "static" if static_mode is not None else "cpu_kernels" if view.device.type == "cpu" \
            else "reference"
    if name not in BACKENDS:
        raise UserError(f"backend must be one of auto, {', '.join(BACKENDS)}, got {name!r}")
    if name == "static":
        return StaticBackend(view, static_mode or "eager")
    if static_mode is not None:
        raise UserError(f"static_passes={static_mode!r} runs on the static backend, not on {name!r}: "
                        f"leave backend unset or pass backend='static'")
    return CpuKernelsBackend(view) if name == "cpu_kernels" else ReferenceBackend(view)


__all__ = ["BACKENDS", "Backend", "CpuKernelsBackend", "FusedDrafts", "ReferenceBackend", "STATIC_MODES",
           "StaticBackend", "make_backend"]
