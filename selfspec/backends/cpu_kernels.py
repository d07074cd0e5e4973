"""The CPU kernels backend: each round operation in one compiled call (`backends/cpu_rounds`: the decoding
calls, built into one extension with the model's passes, `model/kernels`), fused rounds too.

A small model's decoding step on a CPU is bound by the host's work between tensor operations, not by
arithmetic, so the round's operations run as compiled calls: the early exit's k drafts in one
(`round_kernels.draft_loop`: embedding row, `blocks_pass` over [0, E), final norm, draft head, argmax
and η per step, then the last draft's pass), a step whose drafts need the host between steps (a
grammar's mask and forced tokens, copies, an exit block) in one (`round_kernels.draft_step`), the
choice from exit states in one (`round_kernels.draft_choice`), the verification in one
(`round_kernels.verify_greedy`), and many greedy rounds of one row in one
(`round_kernels.greedy_rounds`, the declared capability `fused_rounds`). Each call is the reference's
operations in the same order, so the same bits, without the Python between them; each declines,
having run nothing, where it does not apply (the kernels off or missing, weights off the CPU, a window
that cuts a slot, a layer without a buffer yet, hooks on the embedding, a family without plain blocks
such as GPT-2), and the engine runs that part as torch operations.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..model import kernels
from ..model.adapters import LlamaFamilyAdapter
from ..model.fast import hooked
from ..sampling import sure_drafts
from . import cpu_rounds as round_kernels
from .base import Backend, FusedDrafts


class CpuKernelsBackend(Backend):
    """`Backend` on selfspec's compiled CPU kernels (see the module docstring)."""

    name = "cpu_kernels"
    fused_rounds = True
    verifies_sampled = True

    def __init__(self, view):
        super().__init__(view)
        adapter = view.adapter
        # a family without plain blocks (GPT-2): every call declines
        self.adapter = adapter if isinstance(adapter, LlamaFamilyAdapter) else None
        self._plain_lookup: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # embedding -> plain?
        self._exit_blocks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # exit block -> Block?
        self._exit_blocks_of = None  # the blocks' kernel objects the exit blocks were made beside

    @property
    def chooses_drafts(self) -> bool:
        # its compiled choice (`draft_choice`) runs on a family with plain blocks while the kernels run
        # products; elsewhere the loop in torch drafts what the steps would
        return self.adapter is not None and kernels.settings().runs("products")

    # -- the protocol ----------------------------------------------------------------------------------
    def draft_loop(self, exit_layer, token, cache, positions, head, k, stop_below=0.0, sampling=None):
        if sampling is not None and sampling.all_greedy:
            sampling = None
        place = self._round_place(0, exit_layer, cache, positions)
        if place is None:
            return None
        slots, cos, sin = place
        weight, bias, ids, vocab = head
        accessor = round_kernels.draft_loop if sampling is None else round_kernels.draft_loop_sampled
        call = self._round_call(accessor, 0, exit_layer, cos, sin, (weight, bias))
        if call is None:
            return None
        made, low = call
        keys, values, first, _, row_starts = slots
        rule = () if sampling is None else (list(sampling.tensors()), positions)  # the draw's inputs
        out = made(low(keys, values, row_starts), self._draft_head(head, stop_below), token, first, k, *rule)
        if not out:
            return None
        cache.written(0, exit_layer, out[-1].shape[1])
        return (out[0], None, out[1]) if sampling is None else tuple(out)

    def draft_choice(self, hidden, head, allowed=None, stop_below=0.0):
        if self.adapter is None or not self.adapter.uses_fast():  # train mode, eager or flash attention
            return None
        fast = self._fast
        made = round_kernels.draft_choice() if kernels.settings().runs("products") else None
        if made is None or fast.head is None or torch.is_grad_enabled():
            return None
        weight, bias, ids, vocab = head
        if hidden.device.type != "cpu" or hidden.dtype not in (torch.float32, torch.bfloat16) or any(
                t is not None and (t.dtype != hidden.dtype or not t.is_contiguous())
                for t in (weight, bias, fast.head[0])):
            return None
        drafts, top = made(hidden.contiguous(), self._draft_head(head, stop_below), allowed)
        return drafts, bool(sure_drafts(top[None], stop_below))  # η's rule: some row's draft is sure

    def draft_step(self, exit_layer, tokens, cache, positions, head, exit_block=None, allowed=None,
                   stop_below=0.0):
        return self._draft_step(exit_layer, tokens, cache, positions, head, exit_block, allowed, stop_below)

    def exit_pass(self, exit_layer, tokens, cache, positions, head, exit_block=None):
        return self._draft_step(exit_layer, tokens, cache, positions, head, exit_block, None, 0.0,
                                choose=False)

    def verify_greedy(self, start, end, cache, positions, drafts, hidden=None, tokens=None, allowed=None):
        return self._verify(start, end, cache, positions, drafts, hidden, tokens, allowed, None)

    def verify_sampled(self, start, end, cache, positions, drafts, q, sampling, hidden=None, tokens=None,
                       allowed=None):
        if allowed is not None:  # a grammar's masks on sampled rows: the engine's own verification
            return None
        return self._verify(start, end, cache, positions, drafts, hidden, tokens, None, (q, sampling))

    def _verify(self, start, end, cache, positions, drafts, hidden, tokens, allowed, sampled):
        """`verify_greedy`, or with `sampled` (q, the rows' `RowSampling`) `verify_sampled`."""
        place = self._round_place(start, end, cache, positions)
        if place is None:
            return None
        slots, cos, sin = place
        norm = self._fast.head
        if norm is None:  # a hooked or quantised LM head: the head stays the model's own
            return None
        accessor = round_kernels.verify_greedy if sampled is None else round_kernels.verify_sampled
        call = self._round_call(accessor, start, end, cos, sin, (norm[2], norm[3]))
        if call is None:
            return None
        made, passes = call
        keys, values, first, _, row_starts = slots
        rule = ((allowed,) if sampled is None
                else (sampled[0], list(sampled[1].tensors()), positions))  # the sampled rule's inputs
        out = made(passes(keys, values, row_starts), self._target_head(), hidden, tokens, first, drafts,
                   *rule)
        if not out:
            return None
        cache.written(start, end)
        return out[0]

    def greedy_rounds(self, token, cache, start, drafts: FusedDrafts, eos, max_tokens, max_rounds,
                      overlap=False, sampling=None):
        adapter = self.adapter
        if (adapter is None or not adapter.uses_fast() or adapter.rope_per_call
                or not kernels.settings().runs("decode")):
            return None
        k, windows = drafts.k, adapter.windows
        num_layers = len(adapter.layers)
        keys, values = cache.keys[:num_layers], cache.values[:num_layers]
        last = start + max_tokens + k + drafts.copy_length  # past the last slot a round writes
        if any(b is None for b in keys) or any(w is not None and w <= last for w in windows):
            return None
        # the next round's drafts made ahead reach k + 1 slots further; not where a window would cut them
        overlap = overlap and all(w is None or w > last + k + 1 for w in windows)
        last += k + 1 if overlap else 0
        cos, sin = adapter.rope_rows(adapter.embedding.weight[:1, None], last)
        weight, bias, ids, vocab = drafts.head
        call = self._round_call(round_kernels.greedy_rounds, 0, num_layers, cos, sin, (weight, bias))
        if call is None:
            return None
        made, model = call
        history, min_ngram, max_ngram, copy_limit = drafts.copies() or (None, 1, 0, 0)
        rounds = round_kernels.state_types()[2](
            start=start, token=token, k=k, eos=eos, max_tokens=max_tokens, max_rounds=max_rounds,
            history=history, min_ngram=min_ngram, max_ngram=max_ngram, copy_limit=copy_limit, overlap=overlap,
            sampling=[] if sampling is None else list(sampling.tensors()))
        out = made(model(keys, values), drafts.exit_layer, self._target_head(),
                   self._draft_head(drafts.head, drafts.stop_below), rounds)
        if not out:
            return None
        out = tuple(t.numpy() for t in out)
        cache.hold([start + len(out[0])])  # every layer holds the slots up to the pending token
        return out

    # -- the pieces ------------------------------------------------------------------------------------
    @property
    def _fast(self):
        return None if self.adapter is None else self.adapter.fast

    @property
    def _mask_value(self) -> float:
        """What the engine's mask holds where a query may not look (`DecoderView._mask`'s)."""
        return torch.finfo(self.adapter.embedding.weight.dtype).min

    def _draft_step(self, exit_layer, tokens, cache, positions, head, exit_block, allowed, stop_below,
                    choose=True):
        """`draft_step` (choose) or `exit_pass` (not): the tokens through blocks [0, E) and the exit
        block's blocks at their own cache layers, then (choose) the head, the mask and the argmax."""
        place = self._round_place(0, exit_layer, cache, positions)
        if place is None:
            return None
        slots, cos, sin = place
        layers, first, extra_slots = [], 0, None
        if exit_block is not None:
            last = slots[3] - 1  # the calls attend to every slot: no window may cut one
            windows = [self.adapter.windows[like] for like in exit_block.init_layers]
            if any(w is not None and w <= last for w in windows):
                return None
            layers = list(exit_block.layers)
            first = layers[0].self_attn.layer_idx  # the exit blocks' cache layers: N, N + 1, ..
            extra_slots = cache.slot_buffers(first, first + len(layers))
            if extra_slots is None:
                return None
        weight, bias, ids, vocab = head
        call = self._round_call(round_kernels.draft_step, 0, exit_layer, cos, sin, (weight, bias))
        if call is None:
            return None
        made, low = call
        extra_blocks = [self._exit_block(layer) for layer in layers]
        if None in extra_blocks:
            return None
        keys, values, first_slot, _, row_starts = slots
        extra = low(*(extra_slots[:2] if layers else ([], [])), blocks=extra_blocks)
        out = made(low(keys, values, row_starts), extra, self._draft_head(head, stop_below), tokens,
                   first_slot, allowed, choose)
        if not out:
            return None
        cache.written(0, exit_layer)
        if layers:
            cache.written(first, first + len(layers))
        if not choose:
            return tuple(out)
        draft, hidden, sure = out
        return draft, hidden, bool(sure)

    def _exit_block(self, layer: nn.Module):
        """An exit block as the kernels' `Block` object, made once per module; None where it is not a
        plain SiLU block of the family (the call then declines)."""
        compiled = self._fast.compiled()
        if self._exit_blocks_of is not compiled[0]:  # another build of the extension: make them again
            self._exit_blocks.clear()
            self._exit_blocks_of = compiled[0]
        if layer not in self._exit_blocks:
            b = self._fast.extra(layer, self.adapter.config)
            self._exit_blocks[layer] = (None if b is None or b.act is not F.silu
                                        else self._fast.kernel_block(b))
        return self._exit_blocks[layer]

    def _round_place(self, start: int, end: int, cache, positions):
        """Where a compiled round call over blocks [start, end) at `positions` (B, T) writes and
        attends: (the cache's `slot_buffers`, the rotary cos, sin (B, T, hd)), or None where the call
        does not apply: no fast blocks, a layer without a buffer yet, or an attention window that cuts
        a slot (the calls attend causally to every slot, with no window)."""
        adapter = self.adapter
        if adapter is None or not adapter.uses_fast():
            return None
        slots = cache.slot_buffers(start, end) if hasattr(cache, "slot_buffers") else None
        if slots is None:
            return None
        last = slots[3] - 1  # the last slot written: kv_length - 1
        if any(w is not None and w <= last for w in adapter.windows[start:end]):
            return None
        weight = adapter.embedding.weight
        if adapter.rope_per_call:
            return slots, *adapter.block_extras(weight[:1, None], positions, last)["position_embeddings"]
        cos, sin = adapter.rope_rows(weight[:1, None], last)  # rows of the table: the positions' own values
        if slots[4] is not None:  # rows at their own slots
            return slots, cos[positions], sin[positions]
        batch, first = positions.shape[0], slots[2]  # every row at slots first .. last: a slice
        return slots, cos[first:last + 1].expand(batch, -1, -1), sin[first:last + 1].expand(batch, -1, -1)

    def _round_call(self, accessor, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor, head: tuple):
        """What a compiled round call over blocks [start, end) needs besides the cache's slots: (the compiled
        function, `passes(keys, values, row_starts=None, blocks=...)` making the call's `Passes`: those blocks
        as the kernels' objects (or the `blocks` given) with the buffers given, the embedding table, `cos` and
        `sin` contiguous (a pass's rows (B, T, hd), or the table (L, hd) for `greedy_rounds`)), or None where
        it does not apply: the kernels off or missing (the "rounds"
        level), weights off the CPU (the kernels read host memory), autograd on, an embedding that is not a
        plain lookup (`nn.Embedding` without hooks), no plain final norm + LM head, a head tensor not in the
        model's dtype, angles not in it."""
        fast, embedding = self._fast, self.adapter.embedding
        embed = embedding.weight
        if fast is None or embed.device.type != "cpu":
            return None
        compiled = fast.compiled()
        made = accessor() if kernels.settings().runs("rounds") and compiled is not None else None
        if embedding not in self._plain_lookup:  # checked once per module, as the blocks are at `build`
            self._plain_lookup[embedding] = type(embedding) is nn.Embedding and not hooked(embedding)
        if made is None or fast.head is None or torch.is_grad_enabled() or not self._plain_lookup[embedding]:
            return None
        if (embed.dtype not in (torch.float32, torch.bfloat16) or cos.dtype != embed.dtype
                or any(t is not None and (t.dtype != embed.dtype or not t.is_contiguous())
                       for t in (*head, fast.head[0]))):
            return None
        cos, sin, blocks = cos.contiguous(), sin.contiguous(), compiled[0][start:end]
        kind, mask_value = round_kernels.state_types()[0], self._mask_value

        def passes(keys, values, row_starts=None, blocks=blocks):
            return kind(blocks=blocks, keys=list(keys), values=list(values), embed=embed, cos=cos, sin=sin,
                        mask_value=mask_value, row_starts=row_starts)
        return made, passes

    def _target_head(self):
        """The model's final norm and LM head as the kernels' `Head`."""
        norm, eps, weight, bias = self._fast.head
        return round_kernels.state_types()[1](norm=norm, eps=eps, weight=weight, bias=bias,
                                              vocab=weight.shape[0])

    def _draft_head(self, head: tuple, stop_below: float):
        """A draft head's tensors (`DraftHead.tensors()`) after the model's final norm, and η, as the
        kernels' `Head`."""
        norm, eps = self._fast.head[:2]
        weight, bias, ids, vocab = head
        return round_kernels.state_types()[1](norm=norm, eps=eps, weight=weight, bias=bias, ids=ids,
                                              vocab=vocab, stop_below=stop_below)


__all__ = ["CpuKernelsBackend"]
