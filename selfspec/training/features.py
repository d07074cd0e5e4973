"""Exit features computed once: what an exit adapter trains on when the model itself is frozen.

Under `trainable: adapter` nothing in the model changes, so two things a training step would
otherwise recompute every epoch are fixed: the exit's input, the hidden states after block E, and
the teacher, the model's own next-token distribution. One inference pass over the training blocks
computes both and stores them with `datasets` (saved under a key of their inputs, memory-mapped when
reloaded); each step then
runs only the adapter and the (trimmed) head. On SmolLM2-135M at E = 10 that is one block and a
sixth of the head per token instead of the whole frozen model.

Columns per block of T tokens:
    exit_hidden   (T, D) float32: the hidden states after blocks [0, E)
    teacher_ids   (T, K) int32: the K most likely next tokens of the model's final layer, per position
    teacher_probs (T, K) float32: their probabilities (at `early_exit.temperature`)
    target_mask   (T,) bool: chat data's assistant tokens (all true for plain text)

The teacher is kept as its top K only: the loss (`objective.SelfSpecObjective`) renormalises their
mass, which for K = 1 is CE to the teacher's argmax (`early_exit.kind: argmax`).

The cache holds shards of `SHARD_BLOCKS` blocks, each under the key of its own content: packed data
keeps its order as `data.max_train_blocks` grows, so a larger run computes only the blocks it adds,
and a preparation stopped part-way resumes at its last saved shard.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm

from ..data.blocks import block_tensors
from ..data.packing import cached_blocks, is_cached
from ..model import DecoderView

# Blocks per cached shard of features (a multiple of any usual batch size, so that a shard's batches
# are the whole run's batches)
SHARD_BLOCKS = 200


def _model_fingerprint(name_or_path: str) -> str:
    """Names the weights: the directory's weight files (name, size, modification time), else the name."""
    path = Path(name_or_path)
    parts = [str(path.resolve()) if path.exists() else name_or_path]
    if path.is_dir():
        for weight in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
            stat = weight.stat()
            parts.append(f"{weight.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "|".join(parts)


def features_key(blocks: datasets.Dataset, model_name: str, exit_layer: int, top_k: int,
                 temperature: float, dtype: torch.dtype) -> str:
    """The cache key of the features of `blocks` under a model, an exit, a teacher top K and temperature."""
    digest = hashlib.sha256()
    for tensor in block_tensors(blocks):  # the content: a datasets fingerprint changes on reload
        if tensor is not None:
            digest.update(tensor.numpy().tobytes())
    for part in (_model_fingerprint(model_name), str(exit_layer), str(top_k), repr(float(temperature)),
                 str(dtype)):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@torch.inference_mode()
def compute_exit_features(model, blocks: datasets.Dataset, exit_layer: int, top_k: int,
                          temperature: float = 1.0, batch_size: int = 8, progress: bool = True,
                          bar: tqdm | None = None) -> datasets.Dataset:
    """One pass of the frozen `model` over `blocks` (input_ids (n, T), optional target_mask): the
    columns of this module's docstring, as an in-memory dataset in torch format. `bar`: a progress
    bar to advance (in tokens) instead of a new one."""
    view = DecoderView(model)
    was_training = model.training
    model.eval()
    ids, mask = block_tensors(blocks)  # (n, T) each
    count, length = len(ids), ids.shape[1]
    hidden_rows, id_rows, prob_rows = [], [], []
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=count * length, desc="exit features", unit="tok", unit_scale=True,
                   disable=not progress)
    for start in range(0, count, batch_size):
        input_ids = ids[start:start + batch_size].to(view.device)
        hidden = view.run_layers(view.embed(input_ids), 0, exit_layer)  # (B, T, D)
        final = view.run_layers(hidden, exit_layer, view.num_layers)
        logits = view.exit_logits(final).float() / temperature  # (B, T, V)
        probs, top = torch.softmax(logits, -1).topk(top_k, dim=-1)  # (B, T, K) each
        hidden_rows.append(hidden.float().cpu().numpy())
        id_rows.append(top.to(torch.int32).cpu().numpy())
        prob_rows.append(probs.cpu().numpy())
        bar.update(input_ids.numel())
    if own_bar:
        bar.close()
    model.train(was_training)

    def column(rows: list[np.ndarray]) -> pa.Array:
        """(n, T, X) -> a list-of-lists arrow column (datasets' Array2D layout)."""
        flat = np.concatenate(rows).reshape(count, length, -1)
        inner = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[2])
        return pa.FixedSizeListArray.from_arrays(inner, length)

    table = pa.table({
        "exit_hidden": column(hidden_rows),
        "teacher_ids": column(id_rows),
        "teacher_probs": column(prob_rows),
        "target_mask": pa.FixedSizeListArray.from_arrays(
            pa.array((np.ones((count, length), dtype=bool) if mask is None
                      else np.asarray(mask, dtype=bool)).reshape(-1)), length),
    })
    return datasets.Dataset(datasets.table.InMemoryTable(table)).with_format("torch")


def exit_features(model, blocks: datasets.Dataset, model_name: str, exit_layer: int, top_k: int,
                  temperature: float, cache_dir: str | Path | None, batch_size: int = 8,
                  progress: bool = True) -> datasets.Dataset:
    """`compute_exit_features`, cached under `cache_dir` shard by shard (`SHARD_BLOCKS` blocks each,
    saved atomically, reused by the key of their content)."""
    if cache_dir is None:
        return compute_exit_features(model, blocks, exit_layer, top_k, temperature, batch_size, progress)
    dtype = DecoderView(model).dtype
    starts = range(0, len(blocks), SHARD_BLOCKS)
    parts = [blocks.select(range(start, min(start + SHARD_BLOCKS, len(blocks)))) for start in starts]
    keys = [features_key(part, model_name, exit_layer, top_k, temperature, dtype) for part in parts]
    paths = [Path(cache_dir) / f"exit-features-{key}" for key in keys]
    length = len(blocks[0]["input_ids"]) if len(blocks) else 0
    missing = sum(len(part) for part, path in zip(parts, paths) if not is_cached(path))
    with tqdm(total=missing * length, desc="exit features", unit="tok", unit_scale=True,
              disable=not progress or missing == 0) as bar:
        shards = [cached_blocks(path, lambda part=part: compute_exit_features(
                      model, part, exit_layer, top_k, temperature, batch_size, bar=bar))
                  for part, path in zip(parts, paths)]
    return datasets.concatenate_datasets([shard.with_format(None) for shard in shards]).with_format("torch")


__all__ = ["SHARD_BLOCKS", "compute_exit_features", "exit_features", "features_key"]
