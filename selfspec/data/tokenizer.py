"""A small byte-level BPE tokenizer for a corpus (decode(encode(x)) == x, whitespace included).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from ..files import atomic_directory
from .constants import EOS_TOKEN

logger = logging.getLogger(__name__)

_TOKENIZER_META = "selfspec_tokenizer.json"


def train_tokenizer(
    texts: Iterable[str] | datasets.Dataset,
    out_dir: str | Path,
    vocab_size: int = 4096,
    text_field: str = "text",
    rebuild: bool = False,
) -> PreTrainedTokenizerFast:
    """Train (or reuse) a byte-level BPE tokenizer and save it with ``save_pretrained(out_dir)``.

    ``texts`` is an iterable of strings or a Dataset (its ``text_field`` column is used). The
    tokenizer is lossless: ByteLevel pre-tokenizer (no prefix space) and decoder, no
    normalization, all 256 bytes in the base vocabulary, so ``decode(encode(x)) == x`` for any
    string, tabs, newlines and non-ASCII included. ``<|endoftext|>`` (id 0) is its eos, bos, unk
    and pad token; encoding adds no special tokens by itself (but the literal text
    ``<|endoftext|>`` does encode to it).

    If out_dir already holds a tokenizer trained for the same ``vocab_size`` it is loaded and
    ``texts`` is not read, unless ``rebuild`` is set.
    """
    out_dir = Path(out_dir)
    if not rebuild and _tokenizer_is_current(out_dir, vocab_size):
        return PreTrainedTokenizerFast.from_pretrained(str(out_dir))

    backend = _new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # a merge seen once is noise, not a pattern
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unk ever
        show_progress=False,
    )
    backend.train_from_iterator(_text_batches(texts, text_field), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # The default clean-up rewrites " ," to "," etc. on decode, which breaks source code.
        clean_up_tokenization_spaces=False,
    )
    meta = {"vocab_size_requested": vocab_size, "vocab_size": len(tokenizer), "eos_token": EOS_TOKEN}
    with atomic_directory(out_dir) as tmp_dir:
        tokenizer.save_pretrained(str(tmp_dir))
        (tmp_dir / _TOKENIZER_META).write_text(json.dumps(meta, indent=2) + "\n")
    return PreTrainedTokenizerFast.from_pretrained(str(out_dir))


def load_or_train_tokenizer(
    corpus: datasets.DatasetDict, out_dir: str | Path, vocab_size: int = 4096, rebuild: bool = False
) -> PreTrainedTokenizerFast:
    """The tokenizer in out_dir, trained on ``corpus["train"]["text"]`` first if it is not there yet."""
    return train_tokenizer(corpus["train"], out_dir, vocab_size=vocab_size, rebuild=rebuild)


def _new_byte_level_bpe() -> Tokenizer:
    """An untrained BPE pipeline that maps text to bytes and back without loss."""
    backend = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would change the text and break the round trip.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Only fixes offsets (return_offsets_mapping); it adds no tokens.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _text_batches(texts: Iterable[str] | datasets.Dataset, text_field: str) -> Iterator[list[str]]:
    """Yield lists of strings; batches let the Rust trainer work in parallel."""
    if isinstance(texts, datasets.Dataset):
        for batch in texts.select_columns([text_field]).iter(batch_size=256):
            yield batch[text_field]
        return
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            yield batch
            batch = []
    if batch:
        yield batch


def _tokenizer_is_current(out_dir: Path, vocab_size: int) -> bool:
    """True when out_dir holds a complete tokenizer trained for this vocab_size."""
    meta_path = out_dir / _TOKENIZER_META
    if not (out_dir / "tokenizer.json").is_file() or not meta_path.is_file():
        return False
    requested = json.loads(meta_path.read_text()).get("vocab_size_requested")
    if requested != vocab_size:
        logger.info("retraining %s: it was trained with vocab_size=%s", out_dir, requested)
        return False
    return True


def stdlib_tokenizer_dir(cache_dir: str | Path, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Where ``prepare_stdlib`` keeps the tokenizer trained on the stdlib corpus's train split.

    vocab_size and seed are in the name so that configs with different values do not keep
    retraining (and overwriting) one shared tokenizer.
    """
    return Path(cache_dir) / f"tokenizer-stdlib-v{vocab_size}-s{seed}"
