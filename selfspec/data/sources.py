"""One entry point for any text corpus: "stdlib", local files, saved datasets and Hub names, always
returned as {train, validation, test}.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerFast

from ..errors import UserError
from ..files import cache_dir as user_cache_dir
from .constants import SPLITS
from .stdlib import build_stdlib_corpus
from .tokenizer import load_or_train_tokenizer, stdlib_tokenizer_dir


def prepare_stdlib(
    cache_dir: str | Path | None = None, vocab_size: int = 4096, seed: int = 0, rebuild: bool = False
) -> tuple[datasets.DatasetDict, PreTrainedTokenizerFast]:
    """The embedded default: the stdlib corpus (``cache_dir/"stdlib"``) and its tokenizer.

    Both are built on first use and reused afterwards; ``rebuild`` rebuilds both. ``cache_dir``
    defaults to the user cache directory (`selfspec.files.cache_dir`).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    corpus = build_stdlib_corpus(cache_dir / "stdlib", seed=seed, rebuild=rebuild)
    tokenizer_dir = stdlib_tokenizer_dir(cache_dir, vocab_size, seed)
    tokenizer = load_or_train_tokenizer(corpus, tokenizer_dir, vocab_size, rebuild=rebuild)
    return corpus, tokenizer



# File suffix -> datasets' packaged builder.
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Suffixes that mark a source as a file path even when it does not exist (so a typo gets a
# "does not exist" error, not a confusing Hub lookup).
_FILE_LIKE_SUFFIXES = set(_BUILDERS) | {".csv", ".tsv", ".arrow", ".gz", ".zip", ".md", ".py"}
_SPLIT_ALIASES = {"valid": "validation", "dev": "validation"}
_GLOB_CHARS = re.compile(r"[*?\[]")


def load_text_corpus(
    source: str,
    text_field: str = "text",
    cache_dir: str | Path | None = None,
    validation_fraction: float = 0.05,
    seed: int = 0,
) -> datasets.DatasetDict:
    """Load a text corpus as a DatasetDict with ``train``, ``validation`` and ``test`` splits.

    ``source`` is one of:

    - ``"stdlib"``: the standard-library corpus, built or reused under ``cache_dir/"stdlib"``;
    - a local file, glob or directory of ``.txt``/``.jsonl``/``.json``/``.parquet`` files. A
      ``.txt`` file gives one row per blank-line-separated paragraph (so one big file can still be
      split); json/parquet rows are used as they are;
    - a directory written by ``save_to_disk`` (a DatasetDict or a single Dataset);
    - otherwise a Hugging Face Hub dataset name, passed to ``datasets.load_dataset``.

    A missing ``validation`` or ``test`` split is carved out of ``train`` (each
    ``validation_fraction`` of the original train rows, at least one row), deterministically
    for a given ``seed``. Raises ``UserError`` for a path that does not exist or matches no
    file, an unsupported file type, or a ``text_field`` the data does not have.
    """
    if source == "stdlib":
        corpus = build_stdlib_corpus(Path(cache_dir or user_cache_dir()) / "stdlib", seed=seed)
    else:
        corpus = _load_source(source)
    corpus = datasets.DatasetDict({_SPLIT_ALIASES.get(name, name): split for name, split in corpus.items()})
    _check_text_field(corpus, text_field, source)
    return _ensure_splits(corpus, validation_fraction, seed)


def _load_source(source: str) -> datasets.DatasetDict:
    """Load a non-"stdlib" source as a DatasetDict (whatever splits it has)."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return _as_dataset_dict(datasets.load_from_disk(str(path)))
        return _load_data_files(_data_files_in_dir(path), source)
    if path.is_file():
        return _load_data_files([path], source)
    if _GLOB_CHARS.search(source):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise UserError(
                f"corpus glob {source!r} matches no files; check the pattern and the working directory"
            )
        return _load_data_files(files, source)
    if _looks_like_path(source):
        raise UserError(f"corpus path {source!r} does not exist; check the path (relative to {Path.cwd()})")
    return _load_from_hub(source)


def _looks_like_path(source: str) -> bool:
    """Whether a missing source was meant as a local path rather than a Hub name like "org/name"."""
    return source.startswith(("/", "./", "../", "~")) or Path(source).suffix.lower() in _FILE_LIKE_SUFFIXES


def _data_files_in_dir(directory: Path) -> list[Path]:
    """The supported data files anywhere under directory, sorted for a deterministic row order."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in _BUILDERS)
    if not files:
        supported = "/".join(_BUILDERS)
        raise UserError(
            f"directory {str(directory)!r} holds no {supported} files and no save_to_disk dataset; "
            "point the corpus at the files or the saved dataset"
        )
    return files


def _load_data_files(files: list[Path], source: str) -> datasets.DatasetDict:
    """Load local data files with the packaged builder that matches their (single) type."""
    unknown = sorted({p.suffix or p.name for p in files if p.suffix.lower() not in _BUILDERS})
    if unknown:
        raise UserError(
            f"corpus {source!r} has unsupported file type(s) {', '.join(unknown)}; "
            f"use {', '.join(_BUILDERS)} files or a save_to_disk directory"
        )
    builders = {_BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UserError(
            f"corpus {source!r} mixes file types ({', '.join(sorted(builders))}); use files of one type"
        )
    builder = builders.pop()
    # A .txt line is rarely a document: paragraphs keep multi-line text together.
    options = {"sample_by": "paragraph"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(p) for p in files], **options)


def _load_from_hub(source: str) -> datasets.DatasetDict:
    """Load a Hub dataset by name, turning a failure into a one-line UserError."""
    try:
        return _as_dataset_dict(datasets.load_dataset(source))
    except Exception as error:  # the Hub raises many types (offline, not found, gated)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"corpus {source!r} is not a local path and could not be loaded from the Hub "
            f'({type(error).__name__}: {first_line}); pass an existing path, a glob or "stdlib"'
        ) from error


def _as_dataset_dict(loaded: datasets.Dataset | datasets.DatasetDict) -> datasets.DatasetDict:
    """A single Dataset becomes the train split of a DatasetDict."""
    if isinstance(loaded, datasets.Dataset):
        return datasets.DatasetDict({"train": loaded})
    return loaded


def _check_text_field(corpus: datasets.DatasetDict, text_field: str, source: str) -> None:
    """Raise a UserError naming the existing columns when a split lacks text_field."""
    for name, split in corpus.items():
        if text_field not in split.column_names:
            raise UserError(
                f"corpus {source!r} split {name!r} has no column {text_field!r}; its columns are "
                f"{', '.join(split.column_names)}: set text_field to one of them"
            )


def _ensure_splits(corpus: datasets.DatasetDict, fraction: float, seed: int) -> datasets.DatasetDict:
    """Carve missing validation/test splits out of train, each `fraction` of the original rows."""
    if "train" not in corpus:
        raise UserError(f"corpus has no train split (splits: {', '.join(corpus)}); provide one")
    missing = [name for name in ("validation", "test") if name not in corpus]
    if not missing:
        return corpus
    train = corpus["train"]
    carve_rows = max(1, round(fraction * len(train)))
    if len(train) - carve_rows * len(missing) < 1:
        raise UserError(
            f"train split has {len(train)} rows, too few to carve out {', '.join(missing)}; "
            "provide more rows or those splits"
        )
    result = dict(corpus)
    for name in missing:
        parts = train.train_test_split(test_size=carve_rows, shuffle=True, seed=seed)
        train, result[name] = parts["train"], parts["test"]
    result["train"] = train
    # Standard splits first, any extra splits the source had after them.
    ordered = {name: result.pop(name) for name in SPLITS}
    return datasets.DatasetDict({**ordered, **result})
