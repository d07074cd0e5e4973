"""The exit adapter: one small residual block between block E's output and the final norm.

A frozen model's early exit reads hidden states that the final norm and head were never trained on.
Rather than move the trunk, `trainable: adapter` trains one small block on the exit only:

    h_E -> h_E + W_down · silu(W_up · rmsnorm(h_E)) -> final norm -> LM head      (draft only)

Only the draft reads it, so verification, and with it every output token, is the untouched model's:
the gate shows 0.0% and greedy decoding equals the base model's token for token. It is position-wise
(no attention, so no KV cache of its own), and `W_down` starts at zero, so a new adapter is the raw
exit. Its cost per draft token is 2·D·H multiply-adds (SmolLM2, D = 576, H = 1152: 1.3M, a third
of one block), which the measured draft cost includes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

ADAPTER_FILE = "exit_adapter.safetensors"


class ExitAdapter(nn.Module):
    """Residual MLP (D -> H -> D) on exit hidden states (..., D); the identity at initialisation."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float = 1e-5):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)

    @property
    def shape(self) -> dict:
        return {"hidden_size": self.up.in_features, "intermediate_size": self.up.out_features}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(nn.functional.silu(self.up(self.norm(hidden))))


def save_exit_adapter(adapter: ExitAdapter, directory: str | Path) -> None:
    """Write the adapter's weights into `directory` (a checkpoint being staged)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in adapter.state_dict().items()},
              str(Path(directory) / ADAPTER_FILE))


def load_exit_adapter(directory: str | Path, shape: dict, device=None, dtype=None) -> ExitAdapter:
    """The adapter saved in `directory`, of the `shape` recorded in its selfspec.json."""
    from safetensors.torch import load_file

    adapter = ExitAdapter(shape["hidden_size"], shape["intermediate_size"])
    adapter.load_state_dict(load_file(str(Path(directory) / ADAPTER_FILE)))
    return adapter.to(device=device, dtype=dtype).eval().requires_grad_(False)
