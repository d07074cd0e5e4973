"""Exit adapters: one small trained block between block E's output and the final norm, read by the
draft only.

A frozen model's early exit reads hidden states that the final norm and head were never trained on.
Rather than move the trunk, `trainable: adapter` trains one small block on the exit only:

    h_E -> adapter(h_E) -> final norm -> LM head      (draft only)

Only the draft reads it, so verification, and with it every output token, is the untouched model's:
the gate shows 0.0% and greedy decoding equals the base model's token for token. Two kinds:

- `ExitAdapter` ("mlp"): a residual MLP, h + W_down · silu(W_up · rmsnorm(h)), position-wise (no
  attention, no KV cache), `W_down` zero at the start so a new adapter is the raw exit. Its cost per
  draft token is 2·D·H multiply-adds (SmolLM2, D = 576, H = 1152: a third of one block).
- `ExitBlock` ("block"): a decoder block of the model's own family, a copy of one of its blocks
  (Kangaroo's adapter is one attention layer; a whole block initialised from a trained one starts
  from weights that already read this model's hidden states). It attends over the exit states of
  the whole context, so it sees what a position-wise MLP cannot, and it has a KV cache of its own:
  cache layer N (after the model's N blocks), which the engine writes at every position the first E
  blocks run on. It costs one block per draft token.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

ADAPTER_FILE = "exit_adapter.safetensors"
ADAPTER_KINDS = ("mlp", "block")


class ExitAdapter(nn.Module):
    """Residual MLP (D -> H -> D) on exit hidden states (..., D); the identity at initialisation."""

    kind = "mlp"
    attends = False  # position-wise: no KV cache of its own

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-5):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    @property
    def shape(self) -> dict:
        return {"kind": self.kind, "hidden_size": self.up.in_features,
                "intermediate_size": self.up.out_features}

    def forward(self, hidden: torch.Tensor, view=None, context=None, cache=None) -> torch.Tensor:
        """(..., D) -> (..., D); `view`, `context` and `cache` are unused (it sees one position)."""
        return hidden + self.down(nn.functional.silu(self.up(self.norm(hidden))))


class ExitBlock(nn.Module):
    """A decoder block of the model's family on the exit states (B, T, D), with its own KV cache slot.

    layer: the block module (a copy of one of the model's); init_layer: the model block it was copied
    from (its attention window is the exit block's); layer_idx: its cache layer, N.
    """

    kind = "block"
    attends = True

    def __init__(self, layer: nn.Module, init_layer: int, layer_idx: int):
        super().__init__()
        self.layer = layer
        self.init_layer = init_layer
        self.layer_idx = layer_idx
        for module in layer.modules():  # the attention writes its keys at cache layer `layer_idx`
            if hasattr(module, "layer_idx"):
                module.layer_idx = layer_idx

    @classmethod
    def from_model(cls, model: nn.Module, init_layer: int) -> ExitBlock:
        """A copy of `model`'s block `init_layer`, writing its keys at cache layer N."""
        from .view import DecoderView

        view = DecoderView(model)
        return cls(copy.deepcopy(view.layers[init_layer]), init_layer, view.num_layers)

    @property
    def shape(self) -> dict:
        return {"kind": self.kind, "init_layer": self.init_layer}

    def forward(self, hidden: torch.Tensor, view, context, cache=None) -> torch.Tensor:
        """Exit states (B, T, D) at the positions of `context` (a `LayerContext` of `view`) ->
        (B, T, D). With a cache the block writes its keys there and attends to every slot the
        context names, as the model's blocks do."""
        return view.run_extra_block(self.layer, self.init_layer, hidden, context, cache)


def new_exit_adapter(kind: str, model: nn.Module, exit_layer: int, size: int | None = None,
                     init_layer: int | None = None) -> nn.Module:
    """A fresh adapter of `kind` for `model`'s exit E: the MLP of width `size` (default 2·D), or a
    block copied from block `init_layer` (default the last: its output is what the final norm and
    head were trained on; on SmolLM2 at E = 10 it learned faster than a copy of block E)."""
    from .view import DecoderView

    view = DecoderView(model)
    if kind == "block":
        return ExitBlock.from_model(model, view.num_layers - 1 if init_layer is None else init_layer)
    width = view.lm_head.weight.shape[1]
    return ExitAdapter(width, size or 2 * width).to(view.device)


def save_exit_adapter(adapter: nn.Module, directory: str | Path) -> None:
    """Write the adapter's weights into `directory` (a checkpoint being staged)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in adapter.state_dict().items()},
              str(Path(directory) / ADAPTER_FILE))


def load_exit_adapter(directory: str | Path, shape: dict, model: nn.Module, device=None,
                      dtype=None) -> nn.Module:
    """The adapter saved in `directory`, of the `shape` recorded in its selfspec.json, for `model`."""
    from safetensors.torch import load_file

    if shape.get("kind", "mlp") == "block":
        adapter = ExitBlock.from_model(model, shape["init_layer"])
    else:
        adapter = ExitAdapter(shape["hidden_size"], shape["intermediate_size"])
    adapter.load_state_dict(load_file(str(Path(directory) / ADAPTER_FILE)))
    return adapter.to(device=device, dtype=dtype).eval().requires_grad_(False)
