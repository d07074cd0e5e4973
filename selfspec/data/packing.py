"""Tokenize, join documents with eos, cut into fixed-length blocks (cached per tokenizer); count tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerFast

from ..errors import UserError
from ..files import atomic_directory

# When max_blocks caps the output, documents are tokenized this many at a time so that a small
# cap on a large split does not tokenize the whole split.
_PACK_SHARD_DOCS = 1024


def pack_dataset(
    split: datasets.Dataset,
    tokenizer: PreTrainedTokenizerFast,
    block_size: int,
    text_field: str = "text",
    num_proc: int | None = None,
    max_blocks: int | None = None,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Tokenize a split and pack it into blocks of exactly ``block_size`` tokens.

    Each document is tokenized without special tokens and followed by ``tokenizer.eos_token_id``;
    the documents are concatenated in row order and cut into consecutive blocks, the incomplete
    last block dropped. So the blocks, joined, are a prefix of ``doc_0 + [eos] + doc_1 + [eos] +
    ...``. ``max_blocks`` keeps only the first blocks. Returns a Dataset with the single column
    ``input_ids`` (int64) in torch format: ``ds[i:j]["input_ids"]`` is a ``(j - i, block_size)``
    tensor. Deterministic; raises UserError if the split has fewer than ``block_size`` tokens.

    ``cache_dir``: keep the packed blocks there (``save_to_disk``), one directory per (split, tokenizer,
    text field, block size, cap), and load them from there next time instead of tokenizing again.
    A real model's 49k-token tokenizer takes seconds per split; every run and evaluation reuses it.
    """
    if cache_dir is not None:
        key = _fingerprint(split._fingerprint, tokenizer, text_field, f"pack:{block_size}:{max_blocks}")
        return cached_blocks(Path(cache_dir) / f"packed-{key}", lambda: pack_dataset(
            split, tokenizer, block_size, text_field, num_proc, max_blocks))
    if block_size < 1:
        raise UserError(f"block_size must be a positive integer, got {block_size}")
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos_token; set one so documents can be separated")
    if text_field not in split.column_names:
        raise UserError(
            f"split has no column {text_field!r}; its columns are {', '.join(split.column_names)}"
        )
    needed = None if max_blocks is None else max_blocks * block_size
    stream = _token_stream(split, tokenizer, text_field, num_proc, needed)  # (N,)

    n_blocks = len(stream) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    if n_blocks == 0:
        raise UserError(
            f"split has {len(stream)} tokens, fewer than block_size={block_size}; "
            "use a smaller block_size or more data"
        )
    blocks = pa.FixedSizeListArray.from_arrays(pa.array(stream[: n_blocks * block_size]), block_size)
    table = datasets.table.InMemoryTable(pa.table({"input_ids": blocks}))
    fingerprint = _fingerprint(split._fingerprint, tokenizer, text_field, f"pack:{block_size}:{n_blocks}")
    packed = datasets.Dataset(table, fingerprint=fingerprint)
    return packed.with_format("torch")


def is_cached(cached: Path) -> bool:
    """Whether `cached_blocks` has saved a dataset at `cached`."""
    return (cached / "state.json").is_file()


def cached_blocks(cached: Path, build) -> datasets.Dataset:
    """The blocks saved at `cached` (save_to_disk), memory-mapped; the first time, `build()` them
    and save them atomically (then read them back, so a large build does not stay in memory)."""
    if not is_cached(cached):
        with atomic_directory(cached) as tmp_dir:
            build().save_to_disk(str(tmp_dir))
    return datasets.load_from_disk(str(cached)).with_format("torch")


def count_tokens(blocks, vocab_size: int, chunk: int = 1024) -> np.ndarray:
    """Occurrences of every token id in packed blocks: (vocab_size,) int64.

    blocks: `pack_dataset`'s output, or an (n, T) array/tensor of token ids.
    The frequency ranking of a trimmed draft head (`selfspec.decoding.draft_head`).
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(blocks), chunk):
        part = blocks[start:start + chunk]
        ids = np.asarray(part["input_ids"] if isinstance(part, dict) else part).reshape(-1)
        if ids.size and int(ids.max()) >= vocab_size:
            raise UserError(f"token id {int(ids.max())} is outside the model's {vocab_size}-token "
                            f"vocabulary; count with the model's own tokenizer")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def _token_stream(
    split: datasets.Dataset,
    tokenizer: PreTrainedTokenizerFast,
    text_field: str,
    num_proc: int | None,
    needed: int | None,
) -> np.ndarray:
    """All documents' token ids, each followed by eos, concatenated: shape (N,), int64.

    With ``needed`` set, stops after the first shard of documents that reaches that many tokens.
    """
    if needed is None:
        shards: Iterable[datasets.Dataset] = [split]
    else:
        shards = (
            split.select(range(start, min(start + _PACK_SHARD_DOCS, len(split))))
            for start in range(0, len(split), _PACK_SHARD_DOCS)
        )
    pieces, total = [], 0
    for shard in shards:
        ids = _tokenize_documents(shard, tokenizer, text_field, num_proc)
        pieces.append(ids)
        total += len(ids)
        if needed is not None and total >= needed:
            break
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def _tokenize_documents(
    split: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, text_field: str, num_proc: int | None
) -> np.ndarray:
    """Token ids of each document plus eos, flattened in row order: shape (N,), int64."""
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        # verbose=False: long documents are expected here; they are cut into blocks afterwards.
        encoded = tokenizer(batch[text_field], add_special_tokens=False, verbose=False)
        return {"input_ids": [ids + [eos] for ids in encoded["input_ids"]]}

    tokenized = split.map(
        tokenize,
        batched=True,
        remove_columns=split.column_names,
        num_proc=num_proc,
        # In memory: the ids are flattened into one array right away, and writing cache files
        # next to the corpus would litter it with files keyed on a tokenizer hash.
        keep_in_memory=True,
        # datasets cannot hash a tokenizer reliably; an explicit fingerprint avoids its warning.
        new_fingerprint=_fingerprint(split._fingerprint, tokenizer, text_field, "tokenize"),
        desc="tokenizing",
    )
    column = tokenized.with_format("arrow")["input_ids"]
    return pc.list_flatten(column).to_numpy().astype(np.int64, copy=False)


def _fingerprint(
    dataset_fingerprint: str, tokenizer: PreTrainedTokenizerFast, text_field: str, step: str
) -> str:
    """A stable datasets fingerprint for "this step on this dataset with this tokenizer"."""
    digest = hashlib.sha256()
    for part in (
        dataset_fingerprint,
        tokenizer.backend_tokenizer.to_str(),
        text_field,
        str(tokenizer.eos_token_id),
        step,
    ):
        digest.update(part.encode())
        digest.update(b"\0")  # separator, so ("ab", "c") and ("a", "bc") differ
    return digest.hexdigest()[:16]
