"""Shared fixtures: a tiny local model directory and corpus, so training runs need no download."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

from selfspec.data import train_tokenizer


def _stdlib_snippets(count: int = 80) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in ("functools.py", "textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py"):
        source = (root / name).read_text()
        texts += [source[i:i + 600] for i in range(0, len(source), 600)]
    return texts[:count]


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models run fastest on one intra-op thread (no thread hand-offs for microsecond kernels),
    and stay fast when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """{'model': dir of a 4-layer Llama + tokenizer, 'corpus': .jsonl path, 'tokenizer': the tokenizer}."""
    root = tmp_path_factory.mktemp("tiny_run")
    texts = _stdlib_snippets()
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = train_tokenizer(texts, root / "tokenizer", vocab_size=320)
    model = tiny_model("llama", num_layers=4, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return {"model": root / "model", "corpus": corpus, "tokenizer": tokenizer, "root": root}


@pytest.fixture
def kernel_level():
    """`kernel_level(level)` sets how far selfspec's compiled paths run for the rest of the test
    (`selfspec.model.fast.kernels_up_to`), restored after it."""
    import contextlib

    from selfspec.model import fast

    with contextlib.ExitStack() as stack:
        yield lambda level: stack.enter_context(fast.kernels_up_to(level))
