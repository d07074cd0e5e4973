"""`selfspec serve` against hostile or careless clients: every value bounded before a request joins a
wave, a row that still fails its wave fails alone, JSON bodies only (415), bodies refused as they
arrive (413), every error in OpenAI's shape with no internal text, unsupported fields refused by name,
/metrics behind the key, limits checked at start-up, and --max-model-len."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import jsonschema
import pytest
from fastapi.testclient import TestClient
from helpers import CHATML, chat_generator

from selfspec import cli
from selfspec.errors import UserError
from selfspec.serving.app import create_app, run_in_thread
from selfspec.serving.options import AppOptions
from selfspec.serving.scheduler import Job, Scheduler

NAME = "tiny"


@pytest.fixture(scope="module")
def generator(tiny_run):
    return chat_generator(tiny_run)


@pytest.fixture(scope="module")
def client(generator):
    with TestClient(create_app(generator, NAME, AppOptions(max_batch=4))) as client:
        yield client


def chat(content: str = "hi", **fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 6, **fields}


def text(prompt: str = "import os\n", **fields) -> dict:
    return {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 6, **fields}


def alone(generator, prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens the engine gives `prompt` alone (greedy)."""
    return generator.generate([prompt], max_new_tokens=max_tokens).sequences[0]


def openai_error(response, status: int, param: str | None = "<any>") -> dict:
    """The response is `status` with OpenAI's error body (all four keys, nothing else); its error."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
    assert error["type"] == ("server_error" if status >= 500 else error["type"])
    if param != "<any>":
        assert error["param"] == param, error
    return error


# -- 1. every value bounded before a request joins a wave ------------------------------------------

@pytest.mark.parametrize("seed", [2**63, -2**63 - 1, 10**40])
def test_a_seed_beyond_int64_is_a_400_in_one_line(client, seed):
    r = client.post("/v1/chat/completions", json=chat(temperature=1, seed=seed))
    error = openai_error(r, 400, "seed")
    assert error["type"] == "invalid_request_error" and "9223372036854775" in error["message"]


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_the_int64_edges_decode(client, seed):
    r = client.post("/v1/completions", json=text(temperature=1, seed=seed))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat", {"temperature": -0.1}, "temperature"),
    ("chat", {"temperature": 2.5}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"top_k": 2**40}, "top_k"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": -1}, "max_completion_tokens"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": 500}, "n"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"top_logprobs": 21}, "top_logprobs"),
    ("chat", {"seed": 1.5}, "seed"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"stop": "x" * 257}, "stop"),
    ("chat", {"stop": [""]}, "stop"),
    ("chat", {"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("text", {"prompt": {"a": 1}}, "prompt"),
    ("text", {"max_tokens": 0}, "max_tokens"),
    ("text", {"logprobs": 6}, "logprobs"),
    ("text", {"best_of": 0}, "best_of"),
])
def test_numbers_and_strings_outside_openais_ranges_are_400s_naming_the_field(client, endpoint, fields,
                                                                             param):
    path, body = ("/v1/chat/completions", chat(**fields)) if endpoint == "chat" else ("/v1/completions",
                                                                                    text(**fields))
    error = openai_error(client.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_a_temperature_that_is_not_a_finite_number_is_a_400(client, raw):
    body = json.dumps(chat()).replace('"temperature": 0', '"temperature": ' + raw.decode()).encode()
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    openai_error(r, 400, "temperature")


def test_a_temperature_too_small_to_divide_by_decodes_greedily(client):
    greedy = client.post("/v1/chat/completions", json=chat("def f(x):", max_tokens=8)).json()
    tiny = client.post("/v1/chat/completions", json=chat("def f(x):", max_tokens=8, temperature=1e-30)).json()
    assert tiny["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_null_in_an_optional_field_takes_its_default(client):
    """As OpenAI and vLLM read it: `"max_tokens": null` on /v1/completions was a plain-text 500."""
    nulls = dict.fromkeys(["max_tokens", "seed", "stop", "stream", "stream_options", "n", "top_p", "top_k",
                           "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "user",
                           "response_format", "echo", "suffix", "best_of", "top_logprobs"])
    r = client.post("/v1/completions", json={**text(), **nulls, "temperature": None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens
    nulls = dict.fromkeys(["max_tokens", "max_completion_tokens", "seed", "stop", "stream_options", "tools",
                           "tool_choice", "response_format", "logprobs", "n", "temperature"])
    r = client.post("/v1/chat/completions", json={**chat(), **nulls})
    assert r.status_code == 200, r.text
    openai_error(client.post("/v1/completions", json={**text(), "model": None}), 400, "model")  # not optional


def test_a_scheduler_refuses_a_job_that_would_fail_its_wave(generator):
    scheduler = Scheduler(generator)
    for job in (Job(prompt=[1, 2], max_tokens=4, temperature=1.0, seed=2**63), Job(prompt=[], max_tokens=4),
                Job(prompt=[1, 2], max_tokens=0), Job(prompt=[10**6], max_tokens=2),
                Job(prompt=[1] * 250, max_tokens=10),
                Job(prompt=[1], max_tokens=2, temperature=float("nan"))):
        with pytest.raises(ValueError):
            scheduler.submit(job)
    assert scheduler.waiting == 0


# -- 1. a row that fails inside a wave fails alone -------------------------------------------------

def poison(generator, monkeypatch, bad: list[list[int]]) -> list:
    """The generator's engines fail their next step once a prompt in `bad` was added to them, at the
    start or when it joins; returns the prompts each engine started with."""
    real, calls = generator.engine, []

    def flaky(*args, **kwargs):
        engine, added, started = real(*args, **kwargs), [], []
        add, step = engine.add, engine.step

        def adding(request):
            added.append(request.prompt)
            return add(request)

        def stepping():
            if not started:
                started.append(True)
                calls.append(list(added))
            if any(p in bad for p in added):
                raise RuntimeError("row poison: internal detail")
            return step()
        engine.add, engine.step = adding, stepping
        return engine

    monkeypatch.setattr(generator, "engine", flaky)
    return calls


@pytest.mark.parametrize("poisoned", ["from the start", "joining after text was streamed"])
def test_a_row_that_fails_its_wave_fails_alone_and_the_others_get_what_they_get_alone(generator, monkeypatch,
                                                                                      caplog, poisoned):
    """Greedy rows beside a poisoned one, in the wave from its start or joining it mid-decode beside
    another good row (after the first row streamed text): the good rows get exactly their tokens alone
    and their streamed text exactly once; the bad one the generic error that names its id."""
    ids = {name: generator.chat_prompt([{"role": "user", "content": name}])
           for name in ("def first(x):", "poison", "def third(z):", "def fourth(w):")}
    calls = poison(generator, monkeypatch, [ids["poison"]])
    scheduler = Scheduler(generator, max_batch=8)  # not started: the test runs the wave itself
    first, bad = Job(ids["def first(x):"], 16), Job(ids["poison"], 8)
    third, fourth = Job(ids["def third(z):"], 8), Job(ids["def fourth(w):"], 8)
    sent = {id(job): [] for job in (first, bad, third, fourth)}
    for job in (first, bad, third, fourth):
        job._send = (lambda events: lambda *event: events.append(event))(sent[id(job)])
    take, arrived = first.take, []

    def arrive_after_the_first_round(tokens, *args):  # on the decode thread, after the first round
        if not arrived:
            arrived.append(True)
            scheduler.submit(bad)
            scheduler.submit(fourth)
        return take(tokens, *args)

    if poisoned == "from the start":
        wave = [first, bad, third, fourth]
    else:
        wave = [first, third]
        first.take = arrive_after_the_first_round
    with caplog.at_level(logging.INFO):
        scheduler._decode(wave)
    assert len(calls) > 1 and scheduler.retried_waves >= 1  # the wave failed and was split
    if poisoned != "from the start":  # the bad row joined at a round boundary, after text went out
        assert arrived and first.first_token is not None and calls[0] == [first.prompt, third.prompt]
        assert [event for event in sent[id(first)] if event[0] == "text"]
    for job in (first, third, fourth):
        expected = alone(generator, job.prompt, job.max_tokens)
        assert job.tokens == expected and job.finish_reason in ("stop", "length")
        streamed = "".join(event[1] for event in sent[id(job)] if event[0] == "text")
        assert streamed == job.text == generator.tokenizer.decode(expected, skip_special_tokens=True)
        assert sent[id(job)][-1] == ("done", job.finish_reason)
    assert bad.finish_reason == "error"
    ((kind, message, status),) = sent[id(bad)]
    assert kind == "error" and status == 500 and bad.request_id in message and "poison" not in message
    assert f"request {bad.request_id} failed while decoding" in caplog.text
    assert "row poison: internal detail" in caplog.text
    assert scheduler.failed_rows == 1


def test_a_failing_request_gets_an_openai_500_while_a_stream_beside_it_is_unchanged(generator, monkeypatch):
    """Through a real server: a poisoned request and greedy streams that run at the same time; each
    stream's text is what its prompt gets alone, the poisoned one a 500 in OpenAI's shape naming its id."""
    from concurrent.futures import ThreadPoolExecutor

    bad_prompt = "poisoned prompt"
    poison(generator, monkeypatch, [list(generator.tokenizer(bad_prompt)["input_ids"])])
    port = free_port()
    server = run_in_thread(create_app(generator, NAME, AppOptions(max_batch=8)), port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    goods = [f"def good_{i}(x):" for i in range(3)]

    def stream(prompt):
        with httpx.stream("POST", url, json=text(prompt, max_tokens=12, stream=True), timeout=120) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert all("error" not in chunk for chunk in chunks), chunks
        return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])

    try:
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream, prompt) for prompt in goods]
            failed = pool.submit(httpx.post, url, json=text(bad_prompt), timeout=120).result()
            replies = [s.result() for s in streams]
    finally:
        server.should_exit = True
    error = openai_error(failed, 500)
    assert failed.headers["x-request-id"] in error["message"] and "poison" not in error["message"]
    monkeypatch.undo()
    for prompt, reply in zip(goods, replies):
        ids = generator.tokenizer(prompt)["input_ids"]
        assert reply == generator.tokenizer.decode(alone(generator, ids, 12), skip_special_tokens=True)


# -- 2. JSON bodies only ---------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_not_declared_json_is_a_415(generator, content_type):
    """A web page may post these to a server on localhost without asking (CVE-2021-32677's class)."""
    app = create_app(generator, NAME)
    headers = {} if content_type is None else {"content-type": content_type}
    with TestClient(app) as client:
        for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", text())):
            r = client.post(path, content=json.dumps(body).encode(), headers=headers)
            error = openai_error(r, 415)
            assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
        ok = client.post("/v1/completions", content=json.dumps(text()).encode(),
                         headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
    assert app.state.scheduler.largest_wave == 1  # only the JSON one decoded


# -- 3. a body refused as it arrives ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(port: int, head: bytes, body: bytes) -> int:
    """Send `head` and `body` (the rest never comes) and read the status line of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        answer = b""
        while b"\r\n" not in answer:
            part = sock.recv(4096)
            if not part:
                break
            answer += part
    return int(answer.split(b" ")[1])


def test_a_body_over_the_limit_is_a_413_before_the_rest_of_it_arrives(generator):
    port = free_port()
    server = run_in_thread(create_app(generator, NAME, AppOptions(max_body_bytes=1000)), port)
    try:
        start = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        # chunked: 1,500 bytes arrive in one chunk and the body never ends
        chunk = b'{"model": "tiny", "prompt": "' + b"x" * 1500
        assert status_of(port, start + b"Transfer-Encoding: chunked\r\n\r\n",
                         f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") == 413
        # a declared length over the limit: refused before a byte of the body
        assert status_of(port, start + b"Content-Length: 1000000000\r\n\r\n", b"") == 413
        # within the limit, chunked: served
        body = json.dumps(text()).encode()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=iter([body[:10], body[10:]]),
                       headers={"content-type": "application/json"}, timeout=120)
        assert r.status_code == 200 and r.request.headers["transfer-encoding"] == "chunked"
        too_big = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                             content=iter([body, b" " * 600, b" " * 600]),
                             headers={"content-type": "application/json"})
        error = openai_error(too_big, 413)
        assert error["code"] == "request_too_large"
    finally:
        server.should_exit = True


def answer_to_whole_body(port: int, head: bytes, body: bytes) -> bytes:
    """Send `head` and all of `body` (as a client that writes its whole request before it reads) and
    read the answer until the server closes; b"" when the connection was reset before an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(head + body)
        except OSError:  # the server answered and closed before the rest: read what it said
            pass
        answer = b""
        try:
            while part := sock.recv(65536):
                answer += part
        except ConnectionResetError:
            pass
    return answer


def test_a_client_that_sends_its_whole_oversized_body_reads_the_413(generator):
    """A client that writes its whole oversized body before it reads (as most do), declared or chunked,
    still reads the 413 in OpenAI's shape, each time of several."""
    port = free_port()
    server = run_in_thread(create_app(generator, NAME, AppOptions(max_body_bytes=1000)), port)
    body = b'{"model": "tiny", "prompt": "' + b"x" * (4 << 20) + b'"}'
    heads = {"declared": b"Content-Length: %d\r\n\r\n" % len(body),
             "chunked": b"Transfer-Encoding: chunked\r\n\r\n"}
    try:
        for kind, head in heads.items():
            sent = body if kind == "declared" else f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
            for _ in range(5):
                start = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\n")
                answer = answer_to_whole_body(port, start + head, sent)
                assert answer.startswith(b"HTTP/1.1 413 "), (kind, answer[:80])
                assert b"request_too_large" in answer
    finally:
        server.should_exit = True

# -- 4. every error in OpenAI's shape; no internal text ---------------------------------------------

def test_404_405_and_the_docs_pages_answer_in_openais_shape(client):
    assert "no such endpoint" in openai_error(client.get("/v1/nothing"), 404, None)["message"]
    openai_error(client.post("/v1/nothing", json={}), 404)
    assert "not allowed" in openai_error(client.get("/v1/chat/completions"), 405)["message"]
    for page in ("/docs", "/redoc", "/openapi.json"):
        openai_error(client.get(page), 404)


def test_an_unexpected_exception_is_a_500_that_names_the_request_id_and_logs_the_traceback(
        generator, monkeypatch, caplog):
    def broken(messages):
        raise KeyError("internal secret /home/user/model")

    monkeypatch.setattr(generator, "chat_prompt", broken)
    with TestClient(create_app(generator, NAME)) as client:
        r = client.post("/v1/chat/completions", json=chat())
    error = openai_error(r, 500)
    request_id = r.headers["x-request-id"]
    assert request_id in error["message"] and "secret" not in error["message"] and "KeyError" not in r.text
    assert request_id in caplog.text and "internal secret" in caplog.text


def test_a_chat_templates_own_exception_is_a_400_about_the_messages(generator, monkeypatch, client):
    template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be the "
                "system turn') }}{% endif %}" + CHATML)
    monkeypatch.setattr(generator.tokenizer, "chat_template", template)
    error = openai_error(client.post("/v1/chat/completions", json=chat()), 400, "messages")
    assert "the first message must be the system turn" in error["message"]
    # the template's own bug: a 500
    monkeypatch.setattr(generator.tokenizer, "chat_template", "{{ messages[0].nope.deeper }}")
    error = openai_error(client.post("/v1/chat/completions", json=chat()), 500)
    assert "nope" not in error["message"]


# -- 5. unsupported fields refused by name ----------------------------------------------------------

@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat", {"min_p": 0.1}, "min_p"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True}, "logprobs"),
    ("chat", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("chat", {"guided_regex": "a+"}, "guided_regex"),
    ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"min_tokens": 4}, "min_tokens"),
    ("chat", {"ignore_eos": True}, "ignore_eos"),
    ("text", {"logprobs": 1}, "logprobs"),
    ("text", {"best_of": 3}, "best_of"),
    ("text", {"suffix": "}"}, "suffix"),
    ("text", {"echo": True}, "echo"),
    ("text", {"logit_bias": {"5": -100}}, "logit_bias"),
])
def test_a_field_that_would_change_the_output_and_is_not_supported_is_refused_by_name(client, endpoint,
                                                                                      fields, param):
    path, body = ("/v1/chat/completions", chat(**fields)) if endpoint == "chat" else ("/v1/completions",
                                                                                    text(**fields))
    error = openai_error(client.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_fields_at_their_no_op_values_are_accepted(client):
    r = client.post("/v1/chat/completions", json=chat(logit_bias={}, min_p=0, top_logprobs=0, logprobs=False,
                                                       tool_choice="none", repetition_penalty=1, n=1,
                                                       user="someone", metadata={"a": "b"}))
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json=text(best_of=1, suffix="", echo=False, top_k=-1))
    assert r.status_code == 200, r.text


def test_text_completions_take_response_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.post("/v1/completions", json=text("a number: ", max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), schema)
    broken = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object",
                                                                             "minProperties": "x"}}}
    openai_error(client.post("/v1/completions", json=text(response_format=broken)), 400, "response_format")


# -- 6. access and start-up limits ------------------------------------------------------------------

def test_metrics_need_the_key_when_one_is_set_unless_public(generator):
    with TestClient(create_app(generator, NAME, AppOptions(api_key="k"))) as client:
        assert openai_error(client.get("/metrics"), 401)["code"] == "invalid_api_key"
        assert client.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.get("/health").status_code == 200
        # the key is checked before the body's type: a stranger learns nothing about the server
        plain = client.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"})
        assert plain.status_code == 401
    with TestClient(create_app(generator, NAME, AppOptions(api_key="k", metrics_public=True))) as client:
        assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("flags, named", [
    (["--max-batch", "0"], "--max-batch"), (["--max-queue", "-1"], "--max-queue"),
    (["--max-tokens-cap", "0"], "--max-tokens-cap"), (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--max-model-len", "-5"], "--max-model-len"), (["--port", "70000"], "--port"),
    (["--rounds-per-call", "0"], "--rounds-per-call"), (["--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
    (["--max-connections", "0"], "--max-connections"),
    (["--request-timeout", "inf"], "--request-timeout"),
])
def test_serve_refuses_a_bad_limit_in_one_line_with_exit_2_before_it_loads(tmp_path, flags, named,
                                                                           monkeypatch, capsys):
    import selfspec.checkpoint

    def never(*args, **kwargs):
        raise AssertionError("loaded the model")

    monkeypatch.setattr(selfspec.checkpoint, "load_tuned", never)
    assert cli.main(["serve", str(tmp_path / "model"), *flags]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and named in line


def test_create_app_refuses_bad_limits(generator):
    with pytest.raises(UserError, match="--max-batch must be 1 or more"):
        create_app(generator, NAME, AppOptions(max_batch=0))
    with pytest.raises(UserError, match="over the model's 256 positions"):
        create_app(generator, NAME, AppOptions(max_model_len=10_000))


# -- 7. --max-model-len -----------------------------------------------------------------------------

def test_max_model_len_caps_the_prompt_and_max_tokens_together(generator):
    assert create_app(generator, NAME).state.max_model_len == generator.view.max_positions == 256
    prompt = len(generator.chat_prompt([{"role": "user", "content": "hi"}]))
    limit = prompt + 10
    with TestClient(create_app(generator, NAME, AppOptions(max_model_len=limit))) as client:
        error = openai_error(client.post("/v1/chat/completions", json=chat(max_tokens=11)), 400, "messages")
        assert error["code"] == "context_length_exceeded"
        assert error["message"].startswith(
            f"This model's maximum context length is {limit} tokens. However, you requested {prompt + 11} "
            f"tokens ({prompt} in the messages, 11 in the completion).")
        openai_error(client.post("/v1/completions", json=text("word " * limit)), 400, "prompt")
        assert client.post("/v1/chat/completions", json=chat(max_tokens=10)).status_code == 200
        # no max_tokens: the default (256) where the context has room for it, else the room left
        r = client.post("/v1/chat/completions", json={**chat(), "max_tokens": None})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] <= limit


def test_a_row_cancelled_before_its_wave_fails_is_counted_once(generator, monkeypatch):
    """A client leaves mid-wave (its row ends "cancelled" at a round boundary), then a poisoned row
    joins and the wave fails: the cancelled row is counted once, and not decoded again."""
    ids = [generator.chat_prompt([{"role": "user", "content": name}]) for name in ("def a(x):", "poison",
                                                                                   "def b(y):")]
    calls = poison(generator, monkeypatch, [ids[1]])
    scheduler = Scheduler(generator, max_batch=8)  # not started: the test runs the wave itself
    kept, bad, gone = Job(ids[0], 12), Job(ids[1], 8), Job(ids[2], 12)
    for job in (kept, bad, gone):
        job._send = lambda *event: None
    take, arrived = kept.take, []

    def leave_then_poison(tokens, *args):  # on the decode thread, after the first round
        if not arrived:
            arrived.append(True)
            gone.cancelled = True
            scheduler.submit(bad)
        return take(tokens, *args)

    kept.take = leave_then_poison
    scheduler._decode([kept, gone])
    assert len(calls) > 1 and scheduler.retried_waves >= 1
    assert gone.finish_reason == "cancelled" and scheduler.cancelled_rows == 1
    assert all(gone.prompt not in started for started in calls[1:])  # not decoded again
    assert kept.tokens == alone(generator, kept.prompt, kept.max_tokens) and bad.finish_reason == "error"


def test_memory_goes_back_once_the_server_is_idle_not_between_busy_waves(generator, monkeypatch):
    """The freed memory of a wave, or of a grammar compiled off the decoding thread, is released once
    the queue stays empty for IDLE_RELEASE_SECONDS: once per idle spell, and not at all by a server that
    did nothing."""
    import time

    from selfspec.serving import scheduler as scheduling

    idle = 1.0
    monkeypatch.setattr(scheduling, "IDLE_RELEASE_SECONDS", idle)
    scheduler = Scheduler(generator, max_batch=4)

    def releases_reach(n: int) -> bool:  # the release itself (a garbage collection) may take a while
        deadline = time.time() + 60
        while scheduler.releases < n and time.time() < deadline:
            time.sleep(0.01)
        return scheduler.releases == n

    scheduler.start()
    try:
        time.sleep(1.5 * idle)
        assert scheduler.releases == 0  # idle from the start: nothing was freed
        jobs = [Job(generator.chat_prompt([{"role": "user", "content": f"def f{i}(x):"}]), 6)
                for i in range(3)]
        for job in jobs:
            scheduler.submit(job)
        deadline = time.time() + 60
        while any(job.finish_reason is None for job in jobs) and time.time() < deadline:
            time.sleep(0.01)
        assert scheduler.releases == 0  # not yet: the queue has been empty for less than `idle`
        assert releases_reach(1)  # then once, after the idle spell
        time.sleep(2.5 * idle)
        assert scheduler.releases == 1  # and not again while the server stays idle
        scheduler.memory_freed()  # a grammar compiled on the worker pool
        assert releases_reach(2)
    finally:
        scheduler.stop()


def test_a_failed_waves_engine_gives_back_its_cache_buffers_before_its_halves_decode(tiny_run, monkeypatch):
    """On a backend that keeps key/value buffers from call to call (static passes), a wave whose engine
    failed hands its pool back before its halves decode, which reuse it: one pool in all, without the
    garbage collector (the traceback's frames held the failed engine, and each half made a pool)."""
    import gc

    from selfspec.decoding import runner as runner_module
    from selfspec.decoding.engine import Engine

    generator = chat_generator(tiny_run, static_passes="eager")
    good, bad = (generator.chat_prompt([{"role": "user", "content": c}]) for c in ("def f(x):", "poison"))
    step, made = Engine.step, []

    def failing(self):
        if any(request.prompt == bad for request in self.requests):
            raise RuntimeError("row poison: internal detail")
        return step(self)

    class Counted(runner_module.CachePool):
        def __init__(self, *args):
            made.append(self)
            super().__init__(*args)

    monkeypatch.setattr(Engine, "step", failing)
    monkeypatch.setattr(runner_module, "CachePool", Counted)
    scheduler = Scheduler(generator, max_batch=4)
    jobs = [Job(good, 8), Job(bad, 8), Job(good, 8)]
    gc.disable()
    try:
        scheduler._decode(jobs)
    finally:
        gc.enable()
    assert jobs[1].finish_reason == "error"
    assert {jobs[0].finish_reason, jobs[2].finish_reason} <= {"stop", "length"}
    assert jobs[0].tokens == jobs[2].tokens == alone(generator, good, 8)
    assert len(made) == 1, len(made)
