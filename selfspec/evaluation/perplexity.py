"""The perplexity regression gate: the tuned model's final layer must not lose quality against its base."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..agreement import exit_layer_metrics
from ..model import num_layers as count_layers


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 8, progress: bool = False,
               target_mask: torch.Tensor | None = None) -> tuple[float, int]:
    """Next-token perplexity of the full model on token blocks (n, T), and the number of tokens it
    counted (with `target_mask`, chat data's assistant tokens only)."""
    num_layers = count_layers(model)
    final = exit_layer_metrics(model, blocks, [num_layers], batch_size, progress,
                               target_mask=target_mask)[num_layers]
    return final["perplexity"], final["tokens"]


@dataclass
class GateResult:
    """Outcome of `perplexity_gate`; `passed` decides the command's exit code."""

    base_perplexity: float
    tuned_perplexity: float
    relative_change: float  # (tuned - base) / base; negative means the tuned model is better
    max_increase: float
    tokens: int
    passed: bool

    def summary(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: perplexity base {self.base_perplexity:.4f} -> tuned {self.tuned_perplexity:.4f} "
                f"({self.relative_change:+.2%}; allowed +{self.max_increase:.2%}) on {self.tokens:,} tokens")

    def to_dict(self) -> dict:
        return asdict(self)


def perplexity_gate(tuned_model, base_model, blocks: torch.Tensor, max_increase: float = 0.01,
                    batch_size: int = 8, progress: bool = False,
                    target_mask: torch.Tensor | None = None) -> GateResult:
    """Compare full-model perplexity of tuned vs base on the same blocks (their target tokens); pass
    when the relative increase is at most `max_increase` (0.01 = 1%)."""
    base, tokens = perplexity(base_model, blocks, batch_size, progress, target_mask)
    tuned, _ = perplexity(tuned_model, blocks, batch_size, progress, target_mask)
    change = (tuned - base) / base
    return GateResult(base, tuned, change, max_increase, tokens, change <= max_increase)
