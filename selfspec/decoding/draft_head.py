"""The draft's LM head, over the whole vocabulary or over the V' most frequent tokens only (FR-Spec).

A draft step costs the first E blocks plus the final norm and the *whole* LM head: for a model with
a large vocabulary the head is a fifth of the weights (SmolLM2-135M: 28M of 135M parameters), read
in full for every drafted token. FR-Spec (Zhao et al. 2025, arXiv 2502.14856) observed that a
draft almost never needs the rare tokens: restricting the draft's head to the V' most frequent
token ids (the rows of the head gathered once) cuts its cost to V'/V and loses little acceptance.

Losslessness is untouched: the draft distribution q is simply zero outside the subset (logits -inf
there), and verification uses the full model's p. Greedy drafts are the argmax over the subset;
sampled drafts come from q, and rejection sampling corrects them exactly.

The frequency ranking is counted on the fine-tune's training data and kept in the checkpoint
(`checkpoint.save_token_counts`; `selfspec draft-vocab` counts it for any checkpoint).
"""

from __future__ import annotations

import numpy as np
import torch

from ..draft_loop import trimmed_logits
from ..errors import UserError
from ..model import DecoderView
from ..model.fast import linear


def frequent_tokens(counts, size: int) -> np.ndarray:
    """The `size` most frequent token ids, most frequent first (ties: lower id first).

    counts: (V,) occurrences per token id. Raises when `size` is outside 1..V.
    """
    counts = np.asarray(counts)
    if not 1 <= size <= counts.shape[0]:
        raise UserError(f"draft vocabulary size must be in 1..{counts.shape[0]} (the vocabulary), got {size}")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # by count descending, then id
    return order[:size]


def coverage(counts, sizes) -> dict[int, float]:
    """Share of all counted tokens that fall inside the top-V' ids, for each V' in `sizes`."""
    counts = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    total = counts.sum()
    cumulative = np.cumsum(counts)
    return {int(v): float(cumulative[min(v, len(counts)) - 1] / total) if total else float("nan")
            for v in sizes}


class DraftHead:
    """Final norm + LM head for draft logits (..., D) -> (..., V), optionally over V' ids only, and
    optionally behind an exit adapter (`model.exit_adapter`), which only the draft reads.

    token_ids: None for the model's own head; else the ids the draft may propose (V' of them). Their
    head rows are copied once (V'·D numbers), so rebuild the head after the weights change.
    """

    def __init__(self, view: DecoderView, token_ids=None, adapter=None):
        self.view = view
        self.adapter = adapter
        self.token_ids = None
        if token_ids is None:
            return
        weight = view.lm_head.weight
        vocab_size = weight.shape[0]
        ids = torch.as_tensor(np.asarray(token_ids), dtype=torch.long, device=weight.device)
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise UserError(f"draft token ids must be a non-empty list of ids in 0..{vocab_size - 1}")
        if ids.unique().numel() != ids.numel():
            raise UserError("draft token ids must not repeat")
        self.token_ids = ids
        self.vocab_size = vocab_size
        self.weight = weight.detach()[ids].contiguous()  # (V', D)
        bias = getattr(view.lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[ids].contiguous()

    @property
    def size(self) -> int:
        """V': the number of tokens the draft can propose."""
        return self.view.lm_head.weight.shape[0] if self.token_ids is None else self.token_ids.numel()

    def tensors(self) -> tuple | None:
        """(weight (V', D), bias or None, token ids (V',) or None, V): the head as the compiled draft
        loop reads it (`Backend.draft_loop`); None behind an exit adapter, which the loop does not
        run."""
        if self.adapter is not None:
            return None
        if self.token_ids is None:
            lm_head = self.view.lm_head
            return lm_head.weight, getattr(lm_head, "bias", None), None, lm_head.weight.shape[0]
        return self.weight, self.bias, self.token_ids, self.vocab_size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) exit hidden states -> (..., V) draft logits; -inf outside the subset."""
        if self.adapter is not None:
            hidden = self.adapter(hidden)
        if self.token_ids is None:
            return self.view.exit_logits(hidden)
        return trimmed_logits(linear(self.view.final_norm(hidden), self.weight, self.bias), self.token_ids,
                              self.vocab_size)


__all__ = ["DraftHead", "coverage", "frequent_tokens"]
