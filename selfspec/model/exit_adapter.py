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
- `ExitBlock` ("block"): decoder blocks of the model's own family, copies of some of its blocks
  (Kangaroo's adapter is one attention layer; a whole block initialised from a trained one starts
  from weights that already read this model's hidden states). They attend over the exit states of
  the whole context, so they see what a position-wise MLP cannot, and they have KV caches of their
  own: cache layers N, N + 1, ... (after the model's N blocks), which the engine writes at every
  position the first E blocks run on. Each costs one block per draft token.
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
    """A stack of decoder blocks of the model's family on the exit states (B, T, D), each with its own
    KV cache slot.

    layers: the block modules (copies of the model's), run in order; init_layers: the model blocks
    they were copied from (each one's attention window is its copy's); first_cache_layer: the cache
    layer of the first, N (the next ones take N + 1, ...).
    """

    kind = "block"
    attends = True

    def __init__(self, layers: list[nn.Module], init_layers: list[int], first_cache_layer: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.init_layers = [int(i) for i in init_layers]
        for index, layer in enumerate(self.layers):  # each attention writes at its own cache layer
            for module in layer.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = first_cache_layer + index

    @property
    def cache_layers(self) -> int:
        """KV cache layers it needs after the model's N."""
        return len(self.layers)

    @classmethod
    def from_model(cls, model: nn.Module, init_layers: int | list[int]) -> ExitBlock:
        """Copies of `model`'s blocks `init_layers` (one index or a list), writing their keys at cache
        layers N, N + 1, ..."""
        from .view import DecoderView

        view = DecoderView(model)
        init_layers = [init_layers] if isinstance(init_layers, int) else list(init_layers)
        return cls([copy.deepcopy(view.layers[i]) for i in init_layers], init_layers, view.num_layers)

    @property
    def shape(self) -> dict:
        return {"kind": self.kind, "init_layers": self.init_layers}

    def forward(self, hidden: torch.Tensor, view, context, cache=None) -> torch.Tensor:
        """Exit states (B, T, D) at the positions of `context` (a `LayerContext` of `view`) ->
        (B, T, D). With a cache each block writes its keys there and attends to every slot the
        context names, as the model's blocks do."""
        for layer, like in zip(self.layers, self.init_layers):
            hidden = view.run_extra_block(layer, like, hidden, context, cache)
        return hidden


def new_exit_adapter(kind: str, model: nn.Module, exit_layer: int, size: int | None = None,
                     init_layer: int | None = None, blocks: int = 1) -> nn.Module:
    """A fresh adapter of `kind` for `model`'s exit E: the MLP of width `size` (default 2·D), or
    `blocks` blocks copied from the model's blocks ending at `init_layer` (default the last: its
    output is what the final norm and head were trained on; on SmolLM2 at E = 10 it learned faster
    than a copy of block E), in the model's order."""
    from .view import DecoderView

    view = DecoderView(model)
    if kind == "block":
        last = view.num_layers - 1 if init_layer is None else init_layer
        return ExitBlock.from_model(model, list(range(last - blocks + 1, last + 1)))
    width = view.lm_head.weight.shape[1]
    return ExitAdapter(width, size or 2 * width).to(view.device)


def save_exit_adapter(adapter: nn.Module, directory: str | Path, dtype=None,
                      state: dict | None = None) -> None:
    """Write the adapter's weights (`state`, default its own) into `directory` (a checkpoint being
    staged), its floating tensors at `dtype` where given (a run's float32 master copies at the model's
    dtype)."""
    from safetensors.torch import save_file

    def stored(tensor):
        tensor = tensor.detach()
        return (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()

    state = adapter.state_dict() if state is None else state
    save_file({k: stored(v) for k, v in state.items()}, str(Path(directory) / ADAPTER_FILE))


def load_exit_adapter(directory: str | Path, shape: dict, model: nn.Module, device=None,
                      dtype=None) -> nn.Module:
    """The adapter saved in `directory`, of the `shape` recorded in its selfspec.json, for `model`."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / ADAPTER_FILE))
    if shape.get("kind", "mlp") == "block":
        if "init_layers" in shape:
            adapter = ExitBlock.from_model(model, shape["init_layers"])
        else:  # a one-block checkpoint from before stacks: {init_layer}, its weights under "layer."
            adapter = ExitBlock.from_model(model, shape["init_layer"])
            state = {f"layers.0.{name[len('layer.'):]}": value for name, value in state.items()}
    else:
        adapter = ExitAdapter(shape["hidden_size"], shape["intermediate_size"])
    adapter.load_state_dict(state)
    return adapter.to(device=device, dtype=dtype).eval().requires_grad_(False)
