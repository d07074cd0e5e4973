"""How well each exit layer would draft for the full model: the measure that training (periodic
evaluation) and evaluation (the per-layer tables, the gate) share.

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

from .model import DecoderView

IGNORE_INDEX = -100


def shifted_labels(input_ids: torch.Tensor, target_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token targets aligned with positions: (B, T) where position t predicts input_ids[:, t+1];
    the last position has no target. With `target_mask` (B, T) (chat data: true on assistant
    tokens), a position whose next token is not a target gets none either."""
    labels = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    if target_mask is None:
        return labels
    keep = F.pad(target_mask[:, 1:].bool(), (0, 1), value=False)  # (B, T): is token t+1 a target
    return labels.masked_fill(~keep, IGNORE_INDEX)


def low_precision_to_float(logits: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 logits as float32 (a softmax over a large vocabulary in bf16/fp16 loses the tail)."""
    # Softmax over a large vocabulary in bf16/fp16 loses the tail; float64 inputs stay float64.
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def agreement_metrics(
    exit_logits: torch.Tensor,
    final_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """How well an exit layer would draft for the full model, on (B, T, V) logits.

    Returns a dict with:

    - ``top1_agreement``: fraction of positions where argmax of the exit equals argmax of the final;
    - ``expected_acceptance``: mean over positions of Σ_v min(p_exit(v), p_final(v)) with softmax at
      temperature 1, the probability that speculative sampling accepts a token drafted from the exit;
    - ``top1_matches``, ``acceptance_sum``, ``count``: the sums and the number of positions, so that
      callers aggregate over batches as Σ sums / Σ counts.

    ``mask`` (B, T) selects the positions (all when None). With no position, both means are 0.0.
    """
    if exit_logits.shape != final_logits.shape:
        raise ValueError(
            f"exit_logits and final_logits must have the same shape, got {tuple(exit_logits.shape)} "
            f"and {tuple(final_logits.shape)}"
        )
    if mask is not None and tuple(mask.shape) != tuple(exit_logits.shape[:-1]):
        raise ValueError(f"mask must have shape {tuple(exit_logits.shape[:-1])}, got {tuple(mask.shape)}")
    with torch.no_grad():
        exit_f = low_precision_to_float(exit_logits)
        final_f = low_precision_to_float(final_logits)
        matches = exit_f.argmax(-1) == final_f.argmax(-1)  # (B, T)
        overlap = torch.minimum(exit_f.softmax(-1), final_f.softmax(-1)).sum(-1)  # (B, T)
        if mask is None:
            mask = torch.ones_like(matches)
        mask = mask.to(torch.bool)
        count = int(mask.sum())
        top1_matches = float(matches[mask].sum())
        acceptance_sum = float(overlap[mask].sum())
    return {
        "top1_agreement": top1_matches / count if count else 0.0,
        "expected_acceptance": acceptance_sum / count if count else 0.0,
        "top1_matches": top1_matches,
        "acceptance_sum": acceptance_sum,
        "count": count,
    }


@torch.no_grad()
def exit_layer_metrics(model, blocks: torch.Tensor, layers: list[int] | None = None, batch_size: int = 8,
                       progress: bool = False, reduce=None, target_mask: torch.Tensor | None = None,
                       exit_adapters: dict | None = None, draft_vocab=None) -> dict[int, dict[str, float]]:
    """Per-exit-layer loss, perplexity, top-1 agreement and expected acceptance on `blocks` (n, T).

    layers: exit layers 1..N to report (default all, N included). `reduce`, if given, sums a tensor
    across processes (e.g. `accelerator.reduce`), so each process may pass its own shard of blocks.
    target_mask: (n, T), chat data's assistant tokens: only positions that predict one count.
    exit_adapters: layer -> module applied to that exit's hidden states before the head (an exit
    adapter: the draft reads the exit through it).
    draft_vocab: token ids a trimmed draft head proposes from (V' of them): the exits' agreement and
    expected acceptance are then the trimmed draft's (logits -inf outside the ids, as in
    `decoding.draft_head`); their loss stays the full-vocabulary CE.
    """
    view = DecoderView(model)
    num_layers = view.num_layers
    layers = sorted(set(layers or range(1, num_layers + 1)) | {num_layers})
    was_training = view.model.training
    view.model.eval()
    outside = None  # (V,) true for the ids a trimmed draft head never proposes
    if draft_vocab is not None:
        outside = torch.ones(view.lm_head.weight.shape[0], dtype=torch.bool, device=view.device)
        outside[torch.as_tensor(draft_vocab, dtype=torch.long, device=view.device)] = False
    # Running sums per layer: [loss_sum, top1_matches, acceptance_sum, count]
    sums = torch.zeros(len(layers), 4, dtype=torch.float64)
    batches = range(0, len(blocks), batch_size)
    for start in tqdm(batches, desc="exit layers", disable=not progress, leave=False):
        input_ids = blocks[start:start + batch_size].to(view.device)
        mask = None if target_mask is None else target_mask[start:start + batch_size].to(view.device)
        labels = shifted_labels(input_ids, mask)
        valid = labels != IGNORE_INDEX
        hidden = view.embed(input_ids)
        context = view.context(hidden)
        states = {}
        for index in range(num_layers):
            hidden = view.run_block(index, hidden, context)
            if index + 1 in layers:
                adapter = (exit_adapters or {}).get(index + 1)
                states[index + 1] = (hidden if adapter is None or index + 1 == num_layers
                                     else adapter(hidden, view, context))
        final_logits = view.exit_logits(states[num_layers]).float()  # (B, T, V)
        for row, layer in enumerate(layers):
            logits = final_logits if layer == num_layers else view.exit_logits(states[layer]).float()
            loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum")
            if outside is not None and layer != num_layers:
                logits = logits.masked_fill(outside, float("-inf"))  # what the trimmed draft head sees
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
