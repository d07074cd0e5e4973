"""`selfspec serve`: OpenAI's chat and text completions over the engine, tested in-process (FastAPI's
TestClient) and once through the `openai` client against a real uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from helpers import assert_shape, chat_generator

from selfspec import SelfSpecGenerator
from selfspec.decoding import RoundOutput
from selfspec.decoding.engine import ADAPT_ROUNDS
from selfspec.decoding.prefix import PrefixCache
from selfspec.errors import UserError
from selfspec.evaluation.results import ServeLoadReport
from selfspec.serving.app import create_app, merged_text, run_in_thread
from selfspec.serving.options import AppOptions, ServeOptions
from selfspec.serving.scheduler import (
    CALL_SECONDS,
    CPU_DRAFT_MAX_ROWS,
    MAX_CALL_ROUNDS,
    Job,
    QueueFull,
    Scheduler,
)

NAME = "tiny"


@pytest.fixture(scope="module")
def generator(tiny_run):
    # as `selfspec serve` does: prompts prefill through a prefix cache (small chunks: short prompts)
    return chat_generator(tiny_run, prefix_cache=PrefixCache(chunk=4))


@pytest.fixture
def client(generator):
    with TestClient(create_app(generator, NAME, AppOptions(max_batch=4))) as client:
        yield client


def chat(content: str, **fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 12, **fields}


def alone(generator, content: str, max_tokens: int = 12, **kwargs) -> list[int]:
    """The tokens the engine gives the same conversation alone (greedy unless told)."""
    ids = generator.chat_prompt([{"role": "user", "content": content}])
    return generator.generate([ids], max_new_tokens=max_tokens, **kwargs).sequences[0]


def test_a_chat_completion_is_the_models_own_reply_with_usage_and_statistics(client, generator):
    body = client.post("/v1/chat/completions", json=chat("def add(a, b):")).json()
    tokens = alone(generator, "def add(a, b):")
    assert body["object"] == "chat.completion" and body["model"] == NAME
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant",
                                 "content": generator.tokenizer.decode(tokens, skip_special_tokens=True)}
    eos = generator.tokenizer.eos_token_id
    assert choice["finish_reason"] == ("stop" if tokens[-1] == eos else "length")
    prompt = len(generator.chat_prompt([{"role": "user", "content": "def add(a, b):"}]))
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": len(tokens),
                             "total_tokens": prompt + len(tokens)}
    stats = body["selfspec"]
    assert stats["drafter"] == "hybrid" and stats["tokens_per_pass"] >= 1.0


def test_text_completions_stop_at_a_stop_string(client, generator):
    ids = generator.tokenizer("import os\n")["input_ids"]
    full = generator.tokenizer.decode(generator.generate([ids], max_new_tokens=16).sequences[0],
                                      skip_special_tokens=True)
    stop = full[5:8]
    body = client.post("/v1/completions", json={"model": NAME, "prompt": "import os\n", "max_tokens": 16,
                                                 "temperature": 0, "stop": stop}).json()
    (choice,) = body["choices"]
    assert choice["text"] == full[:full.find(stop)] and choice["finish_reason"] == "stop"
    # streamed: the same text, in chunks none of which ever held a part of the stop string
    request = {"model": NAME, "prompt": "import os\n", "max_tokens": 16, "temperature": 0, "stop": stop}
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as r:
        chunks = read_events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def read_events(response) -> list:
    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_stream_sends_the_same_text_in_chunks_then_the_usage(client):
    whole = client.post("/v1/chat/completions", json=chat("class Stack:")).json()
    with client.stream("POST", "/v1/chat/completions",
                       json=chat("class Stack:", stream=True, stream_options={"include_usage": True})) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = read_events(r)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_text_queued_behind_a_slow_client_leaves_as_one_chunk():
    """The stream joins the text events already waiting (a client that fell behind) and keeps the first
    other event for after them; an empty queue leaves the text as it is."""
    import asyncio

    events = asyncio.Queue()
    for event in (("text", "b"), ("text", "c"), ("done", "stop"), ("text", "never")):
        events.put_nowait(event)
    assert merged_text("a", events) == ("abc", ("done", "stop"))
    assert merged_text("x", events) == ("xnever", None)
    assert merged_text("y", events) == ("y", None)


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_or_among_others(generator):
    scheduler = Scheduler(generator, max_batch=4)
    ids = [generator.chat_prompt([{"role": "user", "content": p}]) for p in ("a", "bb", "ccc")]

    def run(prompts, seeds):
        jobs = [Job(prompt=p, max_tokens=10, temperature=1.0, seed=s) for p, s in zip(prompts, seeds)]
        scheduler._decode(jobs)
        return [job.tokens for job in jobs]

    (single,) = run([ids[1]], [7])
    together = run(ids, [3, 7, 11])
    assert together[1] == single


def test_a_cancelled_row_ends_at_the_next_round_and_the_others_go_on(generator):
    scheduler = Scheduler(generator, max_batch=2)
    ids = generator.chat_prompt([{"role": "user", "content": "while True:"}])
    stay, leave = Job(prompt=ids, max_tokens=24), Job(prompt=ids, max_tokens=24)
    take = leave.take

    def cancel_after_first_round(*args):
        leave.cancelled = bool(leave.rounds)
        return take(*args)

    leave.take = cancel_after_first_round
    scheduler._decode([stay, leave])
    assert leave.finish_reason == "cancelled" and 0 < len(leave.tokens) < 24
    assert stay.tokens == alone(generator, "while True:", max_tokens=24, eos_token_id=[])[:len(stay.tokens)]
    assert stay.finish_reason in ("stop", "length") and len(stay.tokens) > len(leave.tokens)


def test_a_json_schema_reply_parses_and_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    body = client.post("/v1/chat/completions", json=chat(
        "Maria, 34", max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})).json()
    reply = body["choices"][0]
    assert reply["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["message"]["content"]), schema)
    broken = {"type": "object", "minProperties": "x"}
    bad = client.post("/v1/chat/completions", json=chat("x", response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": broken}}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("fields, status, param", [
    ({"max_tokens": 5000}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"model": "gpt-4o"}, 400, "model"),
    ({"temperature": 5}, 400, "temperature"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
])
def test_bad_requests_get_an_openai_error_that_names_the_field(client, fields, status, param):
    r = client.post("/v1/chat/completions", json=chat("hi", **fields))
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_too_large_or_not_json_is_refused(generator):
    with TestClient(create_app(generator, NAME, AppOptions(max_body_bytes=200))) as client:
        r = client.post("/v1/chat/completions", json=chat("x" * 300))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = client.post("/v1/chat/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_an_api_key_is_required_when_set(generator):
    with TestClient(create_app(generator, NAME, AppOptions(api_key="s3cret"))) as client:
        assert client.get("/v1/models").status_code == 401
        wrong = client.get("/v1/models", headers={"Authorization": "Bearer s3cres"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == NAME
        assert client.get("/health").status_code == 200  # health needs no key; metrics do (hardening tests)


def test_a_full_queue_answers_429_with_retry_after(generator):
    app = create_app(generator, NAME, AppOptions(max_queue=1))
    scheduler = app.state.scheduler  # not started: nothing leaves the queue
    scheduler.submit(Job(prompt=[1, 2], max_tokens=2))
    with pytest.raises(QueueFull):
        scheduler.submit(Job(prompt=[1, 2], max_tokens=2))
    r = TestClient(app).post("/v1/chat/completions", json=chat("hi"))
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_metrics_count_requests_tokens_and_acceptance(client):
    usage = client.post("/v1/chat/completions", json=chat("def f(x):")).json()["usage"]
    client.post("/v1/chat/completions", json=chat("hi", n=3))
    deadline = time.time() + 60  # a request's tokens count once its wave has ended, maybe after its reply
    while "selfspec_wave_size_count 1.0" not in (text := client.get("/metrics").text):
        assert time.time() < deadline
        time.sleep(0.02)
    assert 'selfspec_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'selfspec_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert f"selfspec_completion_tokens_total {usage['completion_tokens']:.1f}" in text
    assert f"selfspec_prompt_tokens_total {usage['prompt_tokens']:.1f}" in text
    for name in ("selfspec_time_to_first_token_seconds_count 1.0",
                 "selfspec_request_latency_seconds_count 1.0",
                 'selfspec_acceptance_rate{source="early_exit"}', "selfspec_tokens_per_pass",
                 "selfspec_wave_size_count 1.0", "selfspec_prefix_cache_bytes"):
        assert name in text, name
    loaded = float(text.split("\nselfspec_prefix_cache_hit_tokens ")[1].split()[0])
    assert loaded == client.app.state.scheduler.generator.prefix_cache.hit_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live(generator):
    """A real uvicorn server on 127.0.0.1 with a key: {"url", "app"}."""
    port, app = free_port(), create_app(generator, NAME, AppOptions(api_key="k", max_batch=8))
    server = run_in_thread(app, port)
    yield {"url": f"http://127.0.0.1:{port}/v1", "app": app}
    server.should_exit = True


def openai_client(live, key: str = "k"):
    import openai

    return openai.OpenAI(base_url=live["url"], api_key=key, max_retries=0, timeout=120)


def test_the_openai_client_gets_the_engines_reply_whole_and_streamed(live, generator):
    import openai

    client = openai_client(live)
    messages = [{"role": "user", "content": "def f():"}]
    reply = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=10)
    expected = generator.tokenizer.decode(alone(generator, "def f():", max_tokens=10),
                                          skip_special_tokens=True)
    assert reply.choices[0].message.content == expected and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=10,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens
    text = client.completions.create(model=NAME, prompt="import os\n", temperature=0, max_tokens=8)
    ids = generator.tokenizer("import os\n")["input_ids"]
    assert text.choices[0].text == generator.tokenizer.decode(
        generator.generate([ids], max_new_tokens=8).sequences[0], skip_special_tokens=True)
    with pytest.raises(openai.AuthenticationError):
        openai_client(live, key="no").models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, n=2)


def test_sixteen_concurrent_clients_each_get_what_they_get_alone(live, generator):
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client(live)
    prompts = [f"def task_{i}(x):" for i in range(16)]

    def ask(prompt):
        return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                              temperature=0, max_tokens=12).choices[0].message.content

    hits = generator.prefix_cache.hit_tokens
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, prompts))
    assert generator.prefix_cache.hit_tokens > hits  # their shared chat turn's opening came from the cache
    # alone: each prompt again in a cache of its own, empty at first (a miss for every chunk)
    cold = SelfSpecGenerator(generator.model, generator.tokenizer, generator.settings,
                             prefix_cache=PrefixCache(chunk=4))
    for prompt, reply in zip(prompts, replies):
        cold.prefix_cache.clear()
        assert reply == generator.tokenizer.decode(alone(cold, prompt), skip_special_tokens=True)
    assert live["app"].state.scheduler.largest_wave > 1


def test_greedy_waves_over_draft_max_rows_decode_plainly_on_a_cpu_unless_told(generator):
    """On a CPU a greedy wave of more than CPU_DRAFT_MAX_ROWS rows takes plain steps (the server's
    default); a flag's value replaces it. The output is the same (the concurrent clients' test)."""
    assert create_app(generator, NAME).state.scheduler.draft_max_rows == CPU_DRAFT_MAX_ROWS == 2
    assert create_app(generator, NAME, AppOptions(draft_max_rows=None)).state.scheduler.draft_max_rows is None
    scheduler = create_app(generator, NAME, AppOptions(draft_max_rows=0)).state.scheduler  # 0: never draft
    for contents in ("ab", "c"):  # a wave of two rows, and a lone row's compiled rounds
        jobs = [Job(prompt=generator.chat_prompt([{"role": "user", "content": c}]), max_tokens=8)
                for c in contents]
        scheduler._decode(jobs)
        assert all(job.drafted == 0 and job.rounds == len(job.tokens) for job in jobs)
        assert [job.tokens for job in jobs] == [alone(generator, c, 8) for c in contents]


@pytest.mark.parametrize("interval", [0, 3600])
def test_a_streamed_rows_text_goes_out_at_once_then_at_most_every_stream_seconds(monkeypatch, interval):
    """The first text at once (the time to the first token), then one chunk per STREAM_SECONDS however
    many rounds came (each chunk costs the CPUs the decoding needs), and the rest when the row ends."""
    from selfspec.serving import scheduler

    monkeypatch.setattr(scheduler, "STREAM_SECONDS", interval)
    job, sent = Job(prompt=[1], max_tokens=10), []
    job._send = lambda *event: sent.append(event)

    def text():  # the engine's text of the row's tokens so far (`Engine.text`)
        return "".join(chr(ord("a") + i) for i in job.tokens)
    outputs = [RoundOutput(0, [t], None if t < 9 else "length", 1, 0, 0) for t in range(10)]
    assert not any(job.take(o, text) for o in outputs[:-1])
    assert job.take(outputs[-1], text)  # max_tokens
    if interval:
        assert sent == [("text", "a"), ("text", "bcdefghij"), ("done", "length")]
    else:
        assert sent == [("text", c) for c in "abcdefghij"] + [("done", "length")]
    assert job.text == "abcdefghij" and job.finish_reason == "length"


def test_a_lone_rows_calls_last_about_call_seconds_of_its_measured_rounds(generator):
    scheduler = Scheduler(generator)
    assert scheduler.call_rounds() == ADAPT_ROUNDS  # nothing measured yet
    scheduler._pace(40 * CALL_SECONDS / 2, 40)  # rounds of half the call: two a call
    assert scheduler.call_rounds() == 2
    for _ in range(30):  # rounds slower than a call: one a call
        scheduler._pace(3 * CALL_SECONDS, 1)
    assert scheduler.call_rounds() == 1
    for _ in range(60):  # fast rounds: capped
        scheduler._pace(CALL_SECONDS / 1000, 1)
    assert scheduler.call_rounds() == MAX_CALL_ROUNDS
    assert Scheduler(generator, rounds_per_call=5).call_rounds() == 5


@pytest.mark.parametrize("rounds_per_call", [1, None, 64])
def test_a_lone_request_gets_the_same_tokens_however_many_rounds_a_call(generator, rounds_per_call):
    scheduler = Scheduler(generator, rounds_per_call=rounds_per_call)
    scheduler.start()
    try:
        job = Job(generator.chat_prompt([{"role": "user", "content": "def lone(x):"}]), max_tokens=40)
        scheduler.submit(job)
        deadline = time.time() + 120
        while job.finish_reason is None and time.time() < deadline:
            time.sleep(0.01)
        assert job.tokens == generator.generate([job.prompt], max_new_tokens=40).sequences[0]
        if rounds_per_call is None:  # its calls after the first were timed
            assert job.rounds > 2
            assert scheduler.round_seconds is not None and scheduler.round_seconds > 0
    finally:
        scheduler.stop()


def test_a_request_that_arrives_mid_decode_joins_the_running_batch(generator):
    """Continuous batching: jobs submitted while another decodes join it at a round boundary (no wait
    for the wave to end), whatever they ask (a sampled one too), and the greedy ones get what they get
    alone. The two arrive right after the first's first round (which runs alone), while it decodes."""
    scheduler = Scheduler(generator, max_batch=4)
    scheduler.start()
    try:
        prompts = {name: generator.chat_prompt([{"role": "user", "content": name}])
                   for name in ("def first(x):", "def second(y):", "def third(z):")}
        first = Job(prompts["def first(x):"], max_tokens=40)
        second, third = Job(prompts["def second(y):"], max_tokens=6), Job(prompts["def third(z):"], 6,
                                                                           temperature=0.8, seed=3)
        take = first.take

        def arrive_while_first_decodes(tokens, *args):  # after its first round, on the decode thread
            if not first.tokens:
                scheduler.submit(second)
                scheduler.submit(third)
            return take(tokens, *args)

        first.take = arrive_while_first_decodes
        scheduler.submit(first)
        deadline = time.time() + 120
        while any(job.finish_reason is None for job in (first, second, third)) and time.time() < deadline:
            time.sleep(0.01)
        # joined counts rows admitted into a running decode: both ran beside the first
        assert scheduler.joined == 2 and scheduler.largest_wave == 3 and len(third.tokens) == 6
        for job in (first, second):
            assert job.tokens == generator.generate([job.prompt], max_new_tokens=job.max_tokens).sequences[0]
    finally:
        scheduler.stop()


SETTINGS = [{"temperature": 0}, {"temperature": 0.8}, {"temperature": 1.0, "top_k": 5},
            {"temperature": 0.7, "top_p": 0.9}]


@pytest.fixture(scope="module")
def early_exit(tiny_run):
    """The tiny model's early exit at a fixed k: a sampled row's rounds depend on that row alone, so it
    draws its seed's tokens in any batch (copies fill a row's shorter copy with drafts of its own)."""
    return chat_generator(tiny_run, drafter="early_exit")


def test_requests_with_four_settings_decode_in_one_batch_each_as_alone(early_exit):
    scheduler = Scheduler(early_exit, max_batch=8)
    contents = ["def f(x):", "import os", "class A:", "while True:"]
    jobs = [Job(early_exit.chat_prompt([{"role": "user", "content": contents[i % 4]}]), max_tokens=12,
                seed=20 + i, **SETTINGS[(i + i // 4) % 4]) for i in range(8)]
    for job in jobs:  # all queued before the loop starts: one wave of 8 rows
        scheduler.submit(job)
    scheduler.start()
    try:
        deadline = time.time() + 120
        while any(job.finish_reason is None for job in jobs) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert scheduler.largest_wave == 8 and len({job.sampling for job in jobs}) == 4
    for job in jobs:
        s = job.sampling
        expected = early_exit.generate([job.prompt], max_new_tokens=12, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p, seed=job.seed).sequences[0]
        assert job.tokens == expected, s


def test_concurrent_clients_with_their_own_settings_share_the_batch_over_http(early_exit):
    """8 clients at once through uvicorn, four settings among them: each reply is the request's alone,
    and the server's /metrics shows rows decoded together."""
    port, app = free_port(), create_app(early_exit, NAME, AppOptions(max_batch=8))
    server = run_in_thread(app, port)
    try:
        bodies = [chat(f"def f{i}(x):", max_tokens=48, seed=40 + i, **SETTINGS[i % 4]) for i in range(8)]
        replies = [None] * 8

        def ask(i):
            replies[i] = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=bodies[i],
                                    timeout=120).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for body, reply in zip(bodies, replies):
            settings = {k: body[k] for k in ("temperature", "top_k", "top_p") if k in body}
            expected = alone(early_exit, body["messages"][0]["content"], 48, seed=body["seed"], **settings)
            assert reply["choices"][0]["message"]["content"] == early_exit.tokenizer.decode(
                expected, skip_special_tokens=True), body
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        (largest,) = [float(line.split()[1]) for line in metrics.splitlines()
                      if line.startswith("selfspec_largest_batch ")]
        assert largest >= 2
    finally:
        server.should_exit = True


def test_a_client_that_leaves_mid_stream_frees_its_row(live, monkeypatch):
    scheduler = live["app"].state.scheduler
    before = scheduler.cancelled_rows
    take = Job.take

    def slow_take(job, tokens, *args):  # after its first round the row waits until the hang-up is seen,
        deadline = time.time() + 30     # so that it cannot end first on a loaded machine
        while job.tokens and not job.cancelled and time.time() < deadline:
            time.sleep(0.01)
        return take(job, tokens, *args)

    monkeypatch.setattr(Job, "take", slow_take)
    body = chat("while True:", max_tokens=200, stream=True)
    with httpx.stream("POST", f"{live['url']}/chat/completions", json=body,
                      headers={"Authorization": "Bearer k"}, timeout=60) as response:
        next(response.iter_lines())  # the first chunk, then hang up
    for _ in range(600):
        if scheduler.cancelled_rows > before:
            break
        time.sleep(0.05)
    assert scheduler.cancelled_rows == before + 1


def test_a_request_cancelled_while_it_waits_leaves_the_queue_counted(generator):
    scheduler = Scheduler(generator, max_batch=4)  # not started: the test takes the waves itself
    waiting, gone = Job(prompt=[1, 2], max_tokens=2), Job(prompt=[3, 4], max_tokens=2)
    scheduler.submit(gone)
    scheduler.submit(waiting)
    gone.cancelled = True
    assert scheduler._next_wave() == [waiting]
    assert gone.finish_reason == "cancelled" and scheduler.cancelled_rows == 1 and not scheduler.waiting


def test_a_failing_request_gets_a_500_and_the_server_keeps_serving(generator, monkeypatch, caplog):
    real, calls = generator.engine, []

    def fail_once(*args, **kwargs):  # the first wave's engine fails its first step
        engine = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            def boom():
                raise RuntimeError("boom")
            engine.step = boom
        return engine

    monkeypatch.setattr(generator, "engine", fail_once)
    with TestClient(create_app(generator, NAME)) as client:
        r = client.post("/v1/chat/completions", json=chat("hi"))
        error, request_id = r.json()["error"], r.headers["x-request-id"]
        # the client gets the request's id, never the exception's text; the log has both
        assert r.status_code == 500 and error["type"] == "server_error" and request_id in error["message"]
        assert "boom" not in error["message"]
        assert f"request {request_id} failed while decoding" in caplog.text
        assert "RuntimeError: boom" in caplog.text
        assert client.post("/v1/chat/completions", json=chat("hi")).status_code == 200


def test_sigterm_lets_the_request_in_flight_finish_and_exits_0(tiny_run, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    command = [sys.executable, "-m", "selfspec", "serve", str(tiny_run["model"]), "--port", str(port),
               "--served-model-name", NAME]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env={**os.environ, "SELFSPEC_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        result = {}

        def ask():
            result["reply"] = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": NAME, "prompt": "def f(x):", "max_tokens": 64, "temperature": 0})

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        asker.join(timeout=120)
        assert proc.wait(timeout=120) == 0, proc.stdout.read()[-3000:]
        assert result["reply"].status_code == 200 and result["reply"].json()["usage"]["completion_tokens"] > 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_load_benchmark_reports_every_level_and_the_fault_run(tiny_run, tmp_path):
    from selfspec.evaluation.options import ServeLoadOptions
    from selfspec.evaluation.serve_load import serve_load

    options = ServeLoadOptions(model=str(tiny_run["model"]), corpus=str(tiny_run["corpus"]), num_prompts=3,
                               concurrency="1,2", requests=3, max_tokens=6, fault=12, out=str(tmp_path),
                               fault_classes="numeric overflow,wrong content types")
    report = serve_load(options)
    assert_shape(report, ServeLoadReport)
    for arm in ("selfspec", "plain"):
        assert [row["concurrency"] for row in report["levels"][arm]] == [1, 2]
        assert all(row["errors"] == 0 and row["mismatches"] == 0 and row["tokens_per_second"] > 0
                   for row in report["levels"][arm])
    for way in ("served_vs_in_process", "whole_vs_in_process", "in_process_speedup", "served_speedup"):
        assert 0 < report[way]["low"] <= report[way]["speedup"] <= report[way]["high"]
    fault = report["fault"]
    assert fault["bad"] > 0 and fault["bad_refused_4xx"] == fault["bad"] and fault["good_ok"] == fault["good"]
    assert fault["resident_before"] > 0  # the server's own process
    # the fault classes asked for (every class: tests/test_serve_load_faults.py), each in the Markdown
    assert [row["class"] for row in fault["classes"]] == ["numeric overflow", "wrong content types"]
    assert all(row["server_errors"] == 0 and row["good_changed"] == 0 for row in fault["classes"])
    assert "| numeric overflow |" in (tmp_path / "serve_load.md").read_text()
    assert {p.name for p in tmp_path.iterdir()} >= {"serve_load.json", "serve_load.md", "serve_load.png",
                                                     "server.log", "server-plain.log"}


def test_a_server_process_that_cannot_start_is_one_clear_error(tmp_path):
    from selfspec.evaluation.serve_load import server_process

    log = tmp_path / "server.log"
    for flags in ({}, {"overlap": True, "exit_layer": 2}):  # a boolean setting as --overlap
        with pytest.raises(UserError, match="exited with 2 before it answered: see .*server.log"):
            with server_process(ServeOptions(model=str(tmp_path / "no-model"), **flags), log):
                pass
        assert "no-model" in log.read_text() and "unrecognized" not in log.read_text()


def test_a_server_on_captured_passes_replies_as_its_engine_does_alone(tiny_run):
    """`selfspec serve --static-passes graph`: requests of different lengths join and leave one running
    batch (its cache moved onto the pool's buffers of each batch size, `CachePool.home`), and each
    client gets what the same engine gives its request alone."""
    from concurrent.futures import ThreadPoolExecutor

    generator = chat_generator(tiny_run, prefix_cache=PrefixCache(chunk=4), static_passes="graph")
    port, app = free_port(), create_app(generator, NAME, AppOptions(api_key="k", max_batch=4))
    server = run_in_thread(app, port)
    try:
        client = openai_client({"url": f"http://127.0.0.1:{port}/v1"})
        asks = [(f"def task_{i}(x):", 4 + 3 * i) for i in range(6)]

        def ask(prompt_and_length):
            prompt, length = prompt_and_length
            return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                  temperature=0, max_tokens=length).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(ask, asks))
    finally:
        server.should_exit = True
    assert app.state.scheduler.largest_wave > 1
    cold = chat_generator(tiny_run, prefix_cache=PrefixCache(chunk=4), static_passes="graph")
    for (prompt, length), reply in zip(asks, replies):
        cold.prefix_cache.clear()
        assert reply == generator.tokenizer.decode(alone(cold, prompt, max_tokens=length),
                                                   skip_special_tokens=True)


def test_a_wave_drafts_sampled_rows_at_the_sampled_pick_and_greedy_rows_at_the_stored_settings(tiny_run):
    """A sweep's sampled pick (`formats.sampled`) drafts a wave's sampled rows, the checkpoint's own settings
    its greedy rows, whichever request leads the wave (`Lanes`). Each wave's rounds show which k drafted."""
    from selfspec.decoding import SAMPLED, DecodeSettings

    generator = chat_generator(tiny_run)
    generator.settings = DecodeSettings(exit_layer=2, num_speculations=1)
    generator.format_settings = {SAMPLED: DecodeSettings(exit_layer=2, num_speculations=3)}
    waves = []
    scheduler = Scheduler(generator, max_batch=2, on_wave=lambda jobs, stats: waves.append(stats))
    ids = generator.chat_prompt([{"role": "user", "content": "while True:"}])
    greedy = dict(prompt=ids, max_tokens=12)
    sampled = dict(greedy, temperature=0.9, seed=1)
    scheduler._decode([Job(**sampled), Job(**greedy)])
    scheduler._decode([Job(**greedy), Job(**sampled)])
    scheduler._decode([Job(**greedy), Job(**greedy)])
    assert set(waves[0].k_rounds) == set(waves[1].k_rounds) == {1, 3} and set(waves[2].k_rounds) == {1}
    # picks at two temperatures: a wave's sampled rows decode at the one nearest its first sampled request's
    generator.format_settings = {"sampled@0.8": DecodeSettings(exit_layer=2, num_speculations=2),
                                 "sampled@0.3": DecodeSettings(exit_layer=2, num_speculations=4)}
    scheduler._decode([Job(**greedy), Job(**dict(sampled, temperature=0.25))])
    scheduler._decode([Job(**dict(sampled, temperature=1.0)), Job(**greedy)])
    assert set(waves[3].k_rounds) == {1, 4} and set(waves[4].k_rounds) == {1, 2}
