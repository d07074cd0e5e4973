"""How well each exit layer would draft for the full model, measured on held-out token blocks.

For an exit after l blocks (logits = head(final_norm(h_l))) and the final layer N:
- loss: next-token cross-entropy of the exit (perplexity = e^loss; l = N is the model's own),
- top1_agreement: how often the exit's argmax equals the final layer's argmax (= greedy α),
- expected_acceptance: mean Σ_v min(p_l(v), p_N(v)), the acceptance probability of speculative
  sampling at temperature 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..model import DecoderView
from ..training.early_exit import agreement_metrics
from ..training.objective import IGNORE_INDEX, shifted_labels


@torch.no_grad()
def exit_layer_metrics(model, blocks: torch.Tensor, layers: list[int] | None = None, batch_size: int = 8,
                       progress: bool = False, reduce=None) -> dict[int, dict[str, float]]:
    """Per-exit-layer loss, perplexity, top-1 agreement and expected acceptance on `blocks` (n, T).

    layers: exit layers 1..N to report (default all, N included). `reduce`, if given, sums a tensor
    across processes (e.g. `accelerator.reduce`), so each process may pass its own shard of blocks.
    """
    view = DecoderView(model)
    num_layers = view.num_layers
    layers = sorted(set(layers or range(1, num_layers + 1)) | {num_layers})
    was_training = view.model.training
    view.model.eval()
    # Running sums per layer: [loss_sum, top1_matches, acceptance_sum, count]
    sums = torch.zeros(len(layers), 4, dtype=torch.float64)
    batches = range(0, len(blocks), batch_size)
    for start in tqdm(batches, desc="exit layers", disable=not progress, leave=False):
        input_ids = blocks[start:start + batch_size].to(view.device)
        labels = shifted_labels(input_ids)
        valid = labels != IGNORE_INDEX
        hidden = view.embed(input_ids)
        context = view.context(hidden)
        states = {}
        for index in range(num_layers):
            hidden = view.run_block(index, hidden, context)
            if index + 1 in layers:
                states[index + 1] = hidden
        final_logits = view.exit_logits(states[num_layers]).float()  # (B, T, V)
        for row, layer in enumerate(layers):
            logits = final_logits if layer == num_layers else view.exit_logits(states[layer]).float()
            loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum")
            agree = agreement_metrics(logits, final_logits, valid)
            sums[row] += torch.tensor([float(loss_sum), agree["top1_matches"], agree["acceptance_sum"],
                                       agree["count"]], dtype=torch.float64)
    if reduce is not None:
        sums = reduce(sums.to(view.device)).cpu()
    view.model.train(was_training)
    report = {}
    for row, layer in enumerate(layers):
        loss_sum, matches, accept, count = sums[row].tolist()
        count = max(count, 1.0)
        loss = loss_sum / count
        report[layer] = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
                         "top1_agreement": matches / count, "expected_acceptance": accept / count,
                         "tokens": int(count)}
    return report


def format_exit_table(report: dict[int, dict[str, float]], num_layers: int | None = None,
                      baseline: dict[int, dict[str, float]] | None = None) -> str:
    """A Markdown table of `exit_layer_metrics` (with before/after columns when `baseline` is given)."""
    num_layers = num_layers or max(report)
    if baseline is None:
        lines = ["| exit layer | depth | loss | top-1 agreement | expected acceptance |",
                 "|---:|---:|---:|---:|---:|"]
        for layer, m in sorted(report.items()):
            lines.append(f"| {layer} | {layer / num_layers:.0%} | {m['loss']:.3f} | {m['top1_agreement']:.3f} "
                         f"| {m['expected_acceptance']:.3f} |")
    else:
        lines = ["| exit layer | depth | loss before | loss after | top-1 before | top-1 after "
                 "| exp. acc. before | exp. acc. after |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for layer, m in sorted(report.items()):
            b = baseline.get(layer)
            if b is None:
                continue
            lines.append(f"| {layer} | {layer / num_layers:.0%} | {b['loss']:.3f} | {m['loss']:.3f} "
                         f"| {b['top1_agreement']:.3f} | {m['top1_agreement']:.3f} "
                         f"| {b['expected_acceptance']:.3f} | {m['expected_acceptance']:.3f} |")
    return "\n".join(lines)
