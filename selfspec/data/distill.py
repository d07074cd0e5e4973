"""The model's own replies to chat prompts (on-policy distillation data), generated in batches, cached
and resumable.

    selfspec distill-data runs/smollm2/base --prompts sharegpt --out runs/smollm2/distill --limit 256
    selfspec train --config smollm2-135m_chat \
        data.source=runs/smollm2/distill/responses.jsonl

An early exit must agree with the model on the text the model *writes*. Teacher-forced chat text
(`chat.py`) is cheap and large; the model's own replies are the on-policy share. They are written to
``responses.jsonl`` as conversations (``{"id", "messages"}``), which the fine-tune reads like any chat
file. A batch is appended only once it is complete (one write, flushed and synced), so a run killed
at any moment leaves whole lines; the next run skips the prompts already answered, and a torn last
line is cut off before it continues. ``manifest.json`` names the model, its tokenizer and the
settings; a directory made with others is refused rather than mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..files import write_json_atomic
from ..options import Options
from .chat import ChatDataError, load_chat_corpus
from .questions import read_questions

RESPONSES = "responses.jsonl"
MANIFEST = "manifest.json"


JSON_EXTRACT = "json-extract"
JSON_EXTRACT_PER_CATEGORY = 250  # train-split records per category `json-extract` offers (1,000 prompts)


def distill_prompts(source: str, read_prompt_file: Callable[[str], list[str]] | None = None,
                    max_chars: int = 2000) -> list[tuple]:
    """(id, prompt) pairs from a prompt source: ``"sharegpt"`` (the *train* split's first user turns,
    never the held-out ones), a question .jsonl (``turns``: the first turn), or any file
    `read_prompt_file` reads; ``"json-extract"`` gives (id, prompt, schema) triples, the extraction
    prompts of the *train* split with the schema each reply must follow, categories in turn.
    Prompts longer than `max_chars` characters are left out."""
    if source == JSON_EXTRACT:
        from .extraction import CATEGORIES, extraction_prompts

        per = JSON_EXTRACT_PER_CATEGORY
        items = extraction_prompts("train", per)
        by_category = [items[c * per:(c + 1) * per] for c in range(len(CATEGORIES))]
        return [(f"{source}-{group[i].category}-{i}", group[i].message, group[i].schema)
                for i in range(per) for group in by_category]
    if source == "sharegpt":
        pairs = [(row["id"], next(m["content"] for m in row["messages"] if m["role"] == "user"))
                 for row in load_chat_corpus("sharegpt", verbose=False)["train"]]
    elif source.endswith(".jsonl") and _has_turns(source):
        pairs = [(str(q["question_id"]), q["turns"][0]) for q in read_questions(source)]
    elif read_prompt_file is not None:
        pairs = [(f"{Path(source).stem}-{i}", p) for i, p in enumerate(read_prompt_file(source))]
    else:
        raise ChatDataError(f"prompt source {source!r} is not 'sharegpt' or a question .jsonl")
    usable = [(i, p) for i, p in pairs if p.strip() and len(p) <= max_chars]
    if not usable:
        raise ChatDataError(f"prompt source {source!r} holds no usable prompt "
                            f"(non-empty, at most {max_chars} characters); pass another source")
    return usable


def _has_turns(path: str) -> bool:
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.strip():
                try:
                    return "turns" in json.loads(line)
                except (json.JSONDecodeError, TypeError):
                    return False
    return False


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary, merges and chat template."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return digest.hexdigest()[:16]


def _read_done(path: Path) -> set[str]:
    """Ids already answered in `path`; a torn last line (a killed write) is cut off first."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(whole))
    return {json.loads(line)["id"] for line in whole.decode("utf-8").splitlines() if line.strip()}


@dataclass(frozen=True, kw_only=True)
class ReplyOptions(Options):
    """How the replies are decoded; the manifest records them."""

    batch_size: int = 8
    """prompts answered in one batch"""
    max_new_tokens: int = 256
    """the most tokens of a reply"""
    max_prompt_tokens: int = 512
    """skip longer prompts (counted)"""
    temperature: float = 0.0
    """0: greedy replies"""
    seed: int = 0
    """the sampling seed (each batch adds the index of its first prompt)"""


def distill_responses(generator, prompts: list[tuple[str, str]], out_dir: str | Path,
                      options: ReplyOptions | None = None, *, model_name: str, force: bool = False,
                      progress: bool = True) -> dict:
    """Generate the model's replies to `prompts` into `out_dir/responses.jsonl`, resuming a previous run.

    generator: a `SelfSpecGenerator` with its tokenizer (any drafter: decoding is lossless, so the
    replies are the model's own). Prompts go through the chat template; those longer than
    `options.max_prompt_tokens` are skipped and counted. A prompt given as (id, prompt, schema) is
    answered under its JSON schema (structured output: the replies are the model's constrained
    outputs). Returns a summary (rows, tokens, seconds, skipped).
    """
    options = options or ReplyOptions()
    batch_size, max_new_tokens, max_prompt_tokens = (options.batch_size, options.max_new_tokens,
                                                     options.max_prompt_tokens)
    temperature, seed = options.temperature, options.seed
    tokenizer = generator.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ChatDataError(f"{model_name} has no tokenizer with a chat template; "
                            f"distill-data needs an instruct model")
    out_dir = Path(out_dir)
    manifest = {"model": model_name, "tokenizer": tokenizer_fingerprint(tokenizer),
                "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                "temperature": temperature, "seed": seed,
                "constrained": any(len(item) > 2 and item[2] is not None for item in prompts)}
    manifest_path, responses = out_dir / MANIFEST, out_dir / RESPONSES
    if manifest_path.is_file() and not force:
        previous = json.loads(manifest_path.read_text())
        changed = [key for key in manifest if previous.get(key) != manifest[key]]
        if changed:
            raise ChatDataError(f"{out_dir} was made with another {', '.join(changed)} "
                                f"({previous.get('model')}); pass another --out, "
                                f"or --force to start it again")
    elif force and responses.exists():
        responses.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(manifest_path, manifest)

    done = _read_done(responses)
    todo, skipped = [], 0
    for prompt_id, prompt, *schema in prompts:
        if prompt_id in done:
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        todo.append((prompt_id, prompt, ids, schema[0] if schema else None))
    bar = tqdm(total=len(todo), desc="distill", unit="row", disable=not progress)
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(todo), batch_size):
        batch = todo[first:first + batch_size]
        schemas = [schema for *_, schema in batch]
        out = generator.generate([ids for _, _, ids, _ in batch], max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed + first,
                                 json_schema=schemas if any(schemas) else None)
        lines = []
        for (prompt_id, prompt, _, schema), sequence in zip(batch, out.sequences):
            reply = tokenizer.decode(sequence, skip_special_tokens=True).strip()
            tokens += len(sequence)
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
            # the schema stays with its reply: training can tell which tokens it forced (skip_forced)
            lines.append(json.dumps({"id": prompt_id, "messages": messages,
                                     **({} if schema is None else {"json_schema": schema})}))
        # One append per batch, synced: a kill leaves whole batches (and at worst a torn last line).
        with responses.open("a", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        bar.update(len(batch))
        bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    return {"rows": len(done) + len(todo), "new_rows": len(todo), "tokens": tokens, "skipped_long": skipped,
            "seconds": round(time.perf_counter() - start, 1), "file": str(responses)}
