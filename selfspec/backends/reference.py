"""The reference backend: torch operations on any device, the oracle of every other backend."""

from __future__ import annotations

from ..model import kernels
from .base import Backend


class ReferenceBackend(Backend):
    """Every round operation declined (`Backend`'s own behaviour), so the engine runs each pass as torch
    operations through `DecoderView`; on a CPU with selfspec's kernels switched off, so its products are
    MKL's. Slow, plain and device-independent: the other backends are tested against it token for token."""

    name = "reference"
    round_calls = False  # every one declined: the engine does not ask

    def active(self):
        return kernels.using(level=None)


__all__ = ["ReferenceBackend"]
