"""One way in for the training loop and the evaluations: a corpus of any kind, and its packed blocks.

Chat data (ShareGPT, chat .json/.jsonl files) gives blocks with a ``target_mask`` of the assistant
tokens; text (stdlib, .txt, text .jsonl, datasets) gives blocks whose every token is a target.
"""

from __future__ import annotations

import math
from pathlib import Path

import datasets
import torch

from .chat import ChatDataError, is_chat_source, load_chat_corpus, pack_chat_dataset
from .packing import pack_dataset
from .sources import load_text_corpus


def load_corpus(source: str, text_field: str = "text", cache_dir: str | Path | None = None,
                seed: int = 0, keep_truncated: bool = False) -> datasets.DatasetDict:
    """{train, validation, test} of `source`: conversations (rows id, messages) for chat data (with the
    replies marked `truncated` where `keep_truncated`), else text rows (`load_text_corpus`)."""
    if is_chat_source(source):
        return load_chat_corpus(source, keep_truncated=keep_truncated)
    return load_text_corpus(source, text_field, cache_dir=cache_dir, seed=seed)


def pack_split(split: datasets.Dataset, tokenizer, block_size: int, text_field: str = "text",
               max_blocks: int | None = None, cache_dir: str | Path | None = None,
               skip_forced: bool = False) -> datasets.Dataset:
    """Blocks of `block_size` tokens: ``input_ids``, plus ``target_mask`` for a split of conversations
    (and ``draft_mask`` with `skip_forced`: the targets a grammar did not force, `pack_chat_dataset`)."""
    if "messages" in split.column_names:
        return pack_chat_dataset(split, tokenizer, block_size, max_blocks=max_blocks, cache_dir=cache_dir,
                                 skip_forced=skip_forced)
    if skip_forced:
        raise ChatDataError("early_exit.skip_forced needs chat data whose replies carry their json_schema "
                            "(`selfspec distill-data --prompts json-extract`); set it to false for text")
    return pack_dataset(split, tokenizer, block_size, text_field, max_blocks=max_blocks, cache_dir=cache_dir)


def block_tensors(blocks: datasets.Dataset) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids (n, T), target_mask (n, T) or None) of packed blocks."""
    mask = blocks["target_mask"][:] if "target_mask" in blocks.column_names else None
    return blocks["input_ids"][:], mask


def draft_mask(blocks: datasets.Dataset) -> torch.Tensor | None:
    """(n, T) the targets the early exit drafts (`pack_split(skip_forced=True)`), else None."""
    return blocks["draft_mask"][:] if "draft_mask" in blocks.column_names else None


def is_short_batch(micro: int, fraction: float) -> bool:
    """Whether micro-batch `micro` (0-based, counted over the whole run) is one of the `fraction` that
    `DataConfig.short_block_size` cuts short: floor((m + 1) f) > floor(m f), so the short ones lie
    evenly through the run (every other one at 0.5), alike on every process and after a resume."""
    return math.floor((micro + 1) * fraction) > math.floor(micro * fraction)


def cut_blocks(batch: dict, length: int) -> dict:
    """A batch of packed (B, T) blocks as (B * T / length, length) blocks: each block's consecutive
    stretches, the same tokens with contexts of at most `length` (`DataConfig.short_block_size`)."""
    shape = batch["input_ids"].shape
    if shape[1] % length:
        raise ValueError(f"blocks of {shape[1]} tokens cannot be cut into blocks of {length}")
    cut = {}
    for key, value in batch.items():
        if not (torch.is_tensor(value) and value.shape == shape):
            raise ValueError(f"cannot cut {key!r} into shorter blocks: not a (B, T) tensor like input_ids")
        cut[key] = value.reshape(-1, length)
    return cut
