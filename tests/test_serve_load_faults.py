"""`selfspec eval serve-load --fault`'s fault classes against a real `selfspec serve` process on a tiny
model: each class's hostile requests (raw sockets where httpx cannot send them) beside good requests
and a /health probe. Every class answers without a 5xx or a plain-text error, and the good replies
beside it are the ones decoded alone. Latencies are reported, never asserted."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import CHATML

from selfspec.errors import UserError
from selfspec.evaluation.serve_load import (
    FAULT_CLASSES,
    Attack,
    _parse_answer,
    fault_classes,
    fault_table,
    server_process,
)
from selfspec.serving.options import ServeOptions

MAX_TOKENS = 6
ROW_KEYS = {"class", "requests", "statuses", "server_errors", "plain_errors", "unexpected", "failures",
            "good", "good_failed", "good_changed", "health_p50", "health_p99", "health_failed",
            "waiting_after", "seconds", "resident_before", "resident_peak", "resident_after",
            "prefix_cache_after"}


@pytest.fixture(scope="module")
def served(tiny_run, tmp_path_factory):
    """(the server's /v1 URL, its pid, prompts, their replies decoded alone in process)."""
    from selfspec.checkpoint import load_tuned

    # the tiny model with a chat template, so that the messages reach it (bad role orders)
    model = str(tmp_path_factory.mktemp("faults-model"))
    shutil.copytree(tiny_run["model"], model, dirs_exist_ok=True)
    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(model)
    gen = load_tuned(model)
    prompts = ["def add(a, b):", "import os\n", "class A:"]
    reference = []
    for text in prompts:
        out = gen.generate([list(gen.tokenizer(text)["input_ids"])], max_new_tokens=MAX_TOKENS)
        reference.append(gen.tokenizer.decode(out.sequences[0], skip_special_tokens=True))
    log = tmp_path_factory.mktemp("faults") / "server.log"
    with server_process(ServeOptions(model=model, max_batch=4), log) as (url, pid):
        yield url, pid, prompts, reference


@pytest.fixture(scope="module")
def rows(served, tmp_path_factory):
    """Every fault class at a tenth of its counts and sizes, beside two good requests each."""
    url, pid, prompts, reference = served
    rows = fault_classes(url, prompts, reference, MAX_TOKENS, pid, good=2, scale=0.1)
    table = "\n".join(fault_table(rows))
    (tmp_path_factory.mktemp("fault-table") / "faults.md").write_text(table)
    print(table)  # the per-class table, and what failed, for -s
    print("\n".join(f"{row['class']}: {failure}" for row in rows for failure in row["failures"]))
    return rows


def test_every_fault_class_answers_in_openais_shape_and_leaves_good_replies_unchanged(rows):
    assert [row["class"] for row in rows] == list(FAULT_CLASSES)
    for row in rows:
        assert set(row) == ROW_KEYS and row["requests"] > 0
        assert sum(row["statuses"].values()) == row["requests"]
        assert row["resident_before"] > 0 and row["resident_after"] > 0 and row["prefix_cache_after"] >= 0
        assert row["good"] == 2 and row["good_changed"] == 0 and row["good_failed"] == 0, row
        assert row["plain_errors"] == 0 and row["health_failed"] == 0, row  # every error OpenAI's JSON
        # no 5xx; every status the one the class expects (a 4xx for the malformed ones)
        assert row["server_errors"] == 0 and row["unexpected"] == 0 and not row["failures"], row
    table = "\n".join(fault_table(rows))
    assert all(f"| {name} |" in table for name in FAULT_CLASSES)
    json.dumps(rows)  # the report's JSON


def test_pathological_schemas_get_no_5xx(rows):
    """A schema llguidance builds lazily (a repetition of a million, one that refers to itself) or one
    whose first token no vocabulary writes (a required cycle) is refused at the request (400), no longer
    failing its row while decoding (500)."""
    (row,) = [row for row in rows if row["class"] == "pathological schemas"]
    assert row["server_errors"] == 0 and not row["failures"], row["failures"]


def test_an_unknown_fault_class_is_one_clear_error():
    with pytest.raises(UserError, match="no fault class 'floods'"):
        fault_classes("http://127.0.0.1:1/v1", ["x"], ["y"], 4, classes=["floods"])


def test_raw_requests_are_framed_as_told_and_answers_parsed():
    chunked = Attack([b"ab", b"cde"], chunked=True).request()
    assert b"Transfer-Encoding: chunked\r\n" in chunked
    assert chunked.endswith(b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n")
    assert b"Content-Length: 1000\r\n" in Attack(b"", length=1000).request()
    assert b"Content-Type" not in Attack(b"{}", content_type=None).request()
    error = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": None}}).encode()
    assert _parse_answer(b"HTTP/1.1 400 Bad\r\nContent-Length: 2\r\n\r\n" + error) == (400, True)
    assert _parse_answer(b"HTTP/1.1 500 Oops\r\n\r\nInternal Server Error") == (500, False)
    body = b"HTTP/1.1 413 X\r\nTransfer-Encoding: chunked\r\n\r\n" + f"{len(error):x}\r\n".encode() + error
    assert _parse_answer(body + b"\r\n0\r\n\r\n") == (413, True)
    assert _parse_answer(b"") == ("no answer", True)


def test_the_load_levels_send_sampled_requests_seeded_per_prompt(tiny_run, tmp_path):
    """`eval serve-load --temperature`: every request of a level carries the sampling and its prompt's
    seed (`ServeLoadOptions.request_fields`), and each reply is the prompt's seeded draw decoded alone in
    process, whatever the batch the server put it in: the server drafts with the early exit at a fixed
    k, where a sampled row's drafts, and so its draws, depend on the row alone."""
    from selfspec.checkpoint import load_tuned
    from selfspec.evaluation.options import ServeLoadOptions
    from selfspec.evaluation.serve_load import _level

    fixed = dict(drafter="early_exit", exit_layer=2, num_speculations=2)
    options = ServeLoadOptions(model=str(tiny_run["model"]), temperature=0.9, top_p=0.95, seed=40, **fixed)
    assert options.request_fields(2) == {"temperature": 0.9, "top_p": 0.95, "top_k": 0, "seed": 42}
    assert ServeLoadOptions(model="m").request_fields(2) == {"temperature": 0}
    gen = load_tuned(tiny_run["model"], **fixed)
    prompts = ["def add(a, b):", "import os\n", "class A:"]
    alone = []
    for i, text in enumerate(prompts):
        out = gen.generate([list(gen.tokenizer(text)["input_ids"])], max_new_tokens=MAX_TOKENS,
                           **{k: v for k, v in options.request_fields(i).items()})
        alone.append(gen.tokenizer.decode(out.sequences[0], skip_special_tokens=True))
    served = ServeOptions(model=str(tiny_run["model"]), max_batch=4, **fixed)
    with server_process(served, tmp_path / "server.log") as (url, _):
        level = _level(url, prompts, 3, 6, MAX_TOKENS, alone, options.request_fields)
    assert level["errors"] == 0 and level["requests"] == 6
    assert level["mismatches"] == 0, level
