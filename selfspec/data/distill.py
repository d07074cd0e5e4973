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
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import UserError
from ..options import Options
from .chat import ChatDataError, load_chat_corpus
from .questions import read_prompt_file, read_questions
from .replies import RESPONSES, ReplyFile

__all__ = ["RESPONSES", "ReplyOptions", "distill_prompts", "distill_responses"]


JSON_EXTRACT = "json-extract"
JSON_EXTRACT_PER_CATEGORY = 250  # train-split records per category `json-extract` offers (1,000 prompts)


def distill_prompts(source: str, max_chars: int = 2000) -> list[tuple]:
    """(id, prompt) pairs from a prompt source: ``"sharegpt"`` (the *train* split's first user turns,
    never the held-out ones), a question .jsonl (``turns``: the first turn), or a prompt file
    (`read_prompt_file`); ``"json-extract"`` gives (id, prompt, schema) triples, the extraction
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
    else:
        pairs = [(f"{Path(source).stem}-{i}", p) for i, p in enumerate(read_prompt_file(source))]
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


def has_chat_template(tokenizer) -> bool:
    """Whether replies are chat turns (the tokenizer has a chat template) or text continuations."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids a reply to `prompt` continues, as a server makes them: a user turn through the chat
    template with the assistant's turn opened, or (no template) the prompt's text, special tokens added."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def reply_row(prompt_id: str, prompt: str, reply: str, chat: bool, schema: dict | None = None,
              token_ids: list[int] | None = None) -> dict:
    """One line of responses.jsonl: a conversation of the prompt and the reply (stripped), or for a model
    without a chat template the text it continued and the continuation; the schema and the reply's token
    ids where there are some."""
    if chat:
        row = {"id": prompt_id, "messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": reply.strip()}]}
    else:
        row = {"id": prompt_id, "text": prompt + reply}
    if schema is not None:  # the schema stays with its reply: training can tell which tokens it forced
        row["json_schema"] = schema
    if token_ids is not None:
        row["token_ids"] = token_ids
    return row


@dataclass(frozen=True, kw_only=True)
class ReplyOptions(Options):
    """How the replies are decoded; the manifest records them."""

    batch_size: int = 8
    """prompts answered in one batch (in this process)"""
    max_new_tokens: int = 256
    """the most tokens of a reply"""
    max_prompt_tokens: int = 512
    """skip longer prompts (counted)"""
    temperature: float = 0.0
    """0: greedy replies"""
    top_p: float = 1.0
    """sample from the smallest set of tokens whose probability reaches p"""
    seed: int = 0
    """the sampling seed (in this process each batch adds the index of its first prompt; through a server
    each request the index of its prompt)"""

    def check(self):
        for flag, value in (("--batch-size", self.batch_size), ("--max-new-tokens", self.max_new_tokens),
                            ("--max-prompt-tokens", self.max_prompt_tokens)):
            if type(value) is not int or value < 1:
                raise UserError(f"{flag} must be an integer of 1 or more, got {value!r}")
        if not 0 <= self.temperature < float("inf"):
            raise UserError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")


def reply_manifest(model_name: str, tokenizer, options: ReplyOptions, prompts: list[tuple],
                   replies_from: str = "in-process") -> dict:
    """What `manifest.json` records: the model, its tokenizer, the decoding, whether replies follow
    schemas, and where they were generated (`replies_from`: in-process, or server:NAME)."""
    return {"model": model_name, "tokenizer": tokenizer_fingerprint(tokenizer),
            "max_new_tokens": options.max_new_tokens, "max_prompt_tokens": options.max_prompt_tokens,
            "temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
            "constrained": any(len(item) > 2 and item[2] is not None for item in prompts),
            "replies_from": replies_from}


def unanswered(prompts: list[tuple], tokenizer, done: set[str], max_prompt_tokens: int) -> tuple[list, int]:
    """The prompts still to answer, as (index, id, prompt, token ids, schema), in order, and how many were
    skipped for holding more than `max_prompt_tokens` tokens."""
    todo, skipped = [], 0
    for index, (prompt_id, prompt, *schema) in enumerate(prompts):
        if prompt_id in done:
            continue
        ids = prompt_ids(tokenizer, prompt)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        todo.append((index, prompt_id, prompt, ids, schema[0] if schema else None))
    return todo, skipped


def distill_responses(generator, prompts: list[tuple[str, str]], out_dir: str | Path,
                      options: ReplyOptions | None = None, *, model_name: str, force: bool = False,
                      progress: bool = True) -> dict:
    """Generate the model's replies to `prompts` into `out_dir/responses.jsonl`, resuming a previous run.

    generator: a `SelfSpecGenerator` with its tokenizer (any drafter: decoding is lossless, so the
    replies are the model's own). Prompts go through the chat template (a tokenizer without one: the
    replies continue the prompts' text); those longer than `options.max_prompt_tokens` are skipped and
    counted. A prompt given as (id, prompt, schema) is answered under its JSON schema (structured
    output: the replies are the model's constrained outputs). Returns a summary (rows, tokens,
    seconds, skipped).
    """
    options = options or ReplyOptions()
    tokenizer = generator.tokenizer
    if tokenizer is None:
        raise ChatDataError(f"{model_name} has no tokenizer; distill-data needs one to read the prompts")
    chat = has_chat_template(tokenizer)
    replies = ReplyFile(out_dir, reply_manifest(model_name, tokenizer, options, prompts), force)
    todo, skipped = unanswered(prompts, tokenizer, replies.done, options.max_prompt_tokens)
    bar = tqdm(total=len(todo), desc="distill", unit="reply", disable=not progress)
    tokens, start = 0, time.perf_counter()
    for first in range(0, len(todo), options.batch_size):
        batch = todo[first:first + options.batch_size]
        schemas = [schema for *_, schema in batch]
        out = generator.generate([ids for _, _, _, ids, _ in batch], max_new_tokens=options.max_new_tokens,
                                 temperature=options.temperature, top_p=options.top_p,
                                 seed=options.seed + first, json_schema=schemas if any(schemas) else None)
        tokens += sum(len(sequence) for sequence in out.sequences)
        # One append per batch: a kill leaves whole batches (and at worst a torn last line).
        replies.append([reply_row(prompt_id, prompt, tokenizer.decode(sequence, skip_special_tokens=True),
                                  chat, schema)
                        for (_, prompt_id, prompt, _, schema), sequence in zip(batch, out.sequences)])
        bar.update(len(batch))
        bar.set_postfix(tokens_per_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    return {"rows": len(replies.done), "new_rows": len(todo), "tokens": tokens, "skipped_long": skipped,
            "seconds": round(time.perf_counter() - start, 1), "file": str(replies.path)}
