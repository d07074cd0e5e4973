"""Corpora, tokenizers and packed token blocks: a package, one module per concern.

Everything upstream of the training loop lives here:

- ``build_stdlib_corpus``: the embedded default corpus, the running interpreter's standard library
  source, split into train/validation/test by file. It needs no network and no download, so the
  CPU demo and the tests run anywhere.
- ``train_tokenizer`` / ``load_or_train_tokenizer``: a small byte-level BPE tokenizer for that
  corpus (decode(encode(x)) == x, whitespace included).
- ``load_text_corpus``: one entry point for "stdlib", local files, saved datasets and Hub names,
  always returning ``{train, validation, test}``.
- ``pack_dataset``: tokenize, join documents with eos and cut into fixed-length blocks.
- ``load_chat_corpus`` / ``pack_chat_dataset``: conversations (ShareGPT, chat files) split by id,
  rendered by the chat template, packed with a mask of the assistant tokens (``chat``).
- ``load_corpus`` / ``pack_split``: either kind by its source, for the loop and the evaluations.
- ``cut_blocks`` / ``is_short_batch``: mixed lengths, a share of the long blocks' batches cut into
  short blocks (``data.short_block_size``).

Generated artefacts are written atomically (built in a temp dir beside the target, then renamed),
so an interrupted build never leaves a half-written corpus or tokenizer that a later run would
silently reuse.
"""

from .blocks import block_tensors, cut_blocks, draft_mask, is_short_batch, load_corpus, pack_split
from .chat import ChatDataError, is_chat_source, load_chat_corpus, pack_chat_dataset
from .constants import EOS_TOKEN, SPLITS
from .packing import count_tokens, pack_dataset
from .sources import load_text_corpus, prepare_stdlib
from .stdlib import (
    STDLIB_CORPUS_FORMAT,
    build_stdlib_corpus,
    content_exclusion_reason,
    iter_stdlib_files,
    path_exclusion_reason,
    split_for_path,
    stdlib_root,
)
from .tokenizer import load_or_train_tokenizer, stdlib_tokenizer_dir, train_tokenizer

__all__ = ["ChatDataError", "block_tensors", "cut_blocks", "draft_mask", "is_short_batch", "is_chat_source",
           "load_chat_corpus", "load_corpus",
           "pack_chat_dataset", "pack_split", "EOS_TOKEN", "SPLITS",
           "STDLIB_CORPUS_FORMAT", "build_stdlib_corpus",
           "content_exclusion_reason", "count_tokens", "iter_stdlib_files", "load_or_train_tokenizer",
           "load_text_corpus", "pack_dataset", "path_exclusion_reason", "prepare_stdlib", "split_for_path",
           "stdlib_root", "stdlib_tokenizer_dir", "train_tokenizer"]
