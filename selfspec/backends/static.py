"""The static backend: every decoding pass at fixed shapes, for CUDA graphs."""

from __future__ import annotations

from torch import nn

from ..errors import UserError
from ..model.adapters import LlamaFamilyAdapter
from .base import STATIC_MODES, Backend
from .static_passes import WIDTH, StaticPasses


class StaticBackend(Backend):
    """`Backend` on `StaticPasses` (`static_passes.py`): each pass of up to `static_passes.WIDTH`
    positions (plain steps, drafts, verifications; the engine caps rounds to that many) runs at one
    shape against the whole cache, mode "eager" as written, "graph" captured as CUDA graphs by
    `graphs.CapturedPass` (a round's k drafts one graph, its verification another, greedy or sampled).
    The draft loop and the verification run here; the passes the engine runs itself (prefill, an exit
    block's, a draft under a grammar) go through the runner installed on the model's adapter. Caches are
    made at power-of-two capacities with their buffers at once, so a captured pass finds the same shapes
    and addresses again.

    Llama-family models with plain blocks, SDPA attention and a rotary table only (a UserError
    otherwise). Its passes round differently from the CPU kernels' (products are `F.linear`, attention
    written out in float32), so a decode is all static or all not; greedy output equals the same
    backend's plain decoding, in bf16 too (every pass on the same number of rows)."""

    name = "static"
    max_pass_positions = WIDTH  # every pass is padded to this many positions
    pools_caches = True  # captured passes are specific to the cache buffers' shapes and addresses
    verifies_sampled = True  # sampled rounds in two passes of their own (draft loop, verification)

    def __init__(self, view, mode: str = "eager"):
        super().__init__(view)
        if mode == "compile":  # removed: inductor's CUDA graphs skipped the passes' in-place cache writes
            raise UserError("static_passes 'compile' was removed: torch.compile left the passes uncaptured "
                            "on a GPU (its CUDA graphs skip inputs written in place); use 'graph'")
        if mode not in STATIC_MODES:
            raise UserError(f"static_passes must be one of {', '.join(STATIC_MODES)} or None, got {mode!r}")
        adapter = view.adapter
        fast = adapter.fast if isinstance(adapter, LlamaFamilyAdapter) else None
        if (fast is None or fast.head is None or adapter.rope_per_call or not adapter.sdpa
                or type(adapter.embedding) is not nn.Embedding):
            raise UserError(f"static passes need a Llama-family model with plain blocks, SDPA attention and "
                            f"a rotary table ({view.config.model_type} here): leave static_passes unset")
        self.mode = mode
        self.adapter = adapter
        weight = adapter.embedding.weight
        self.passes = StaticPasses(fast, weight, adapter.windows,
                                   lambda capacity: adapter.rope_rows(weight[:1, None], capacity - 1), mode)
        adapter.run_passes_with(self.passes.run)

    def capacity(self, capacity: int) -> int:
        return 1 << max(capacity - 1, 255).bit_length()

    def allocate(self, cache) -> None:
        self.passes.allocate(cache)

    def draft_loop(self, exit_layer, token, cache, positions, head, k, stop_below=0.0, sampling=None):
        if not self.adapter.uses_fast():
            return None
        return self.passes.draft_loop(exit_layer, token, cache, head, k, stop_below, sampling)

    def verify_greedy(self, start, end, cache, positions, drafts, hidden=None, tokens=None, allowed=None):
        if not self.adapter.uses_fast():
            return None
        return self.passes.verify_greedy(start, end, hidden, tokens, cache, drafts, allowed)

    def verify_sampled(self, start, end, cache, positions, drafts, q, sampling, hidden=None, tokens=None,
                       allowed=None):
        if not self.adapter.uses_fast():
            return None
        return self.passes.verify_sampled(start, end, hidden, tokens, cache, drafts, q, sampling, allowed)


__all__ = ["StaticBackend"]
