"""`selfspec serve` and clients that hold it without using it (issue 55, parts 2-4): a non-streamed
request whose client hangs up is cancelled at the next round, a body that trickles in is cut (408),
uvicorn gets its keep-alive timeout and a bound on connections, and the heavy work of a request (chat
template, tokens, grammar) runs on the worker pool after the cheap checks, its grammar compiled once."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient
from helpers import chat_generator

from selfspec import cli
from selfspec.decoding.grammar import GrammarTokenizer
from selfspec.serving.app import create_app, run_in_thread
from selfspec.serving.options import AppOptions
from selfspec.serving.scheduler import Job

NAME = "tiny"


@pytest.fixture(scope="module")
def generator(tiny_run):
    return chat_generator(tiny_run)


def chat(content: str = "hi", **fields) -> dict:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 6, **fields}


def text(prompt: str = "import os\n", **fields) -> dict:
    return {"model": NAME, "prompt": prompt, "temperature": 0, "max_tokens": 6, **fields}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_bytes(path: str, body: bytes, length: int | None = None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


def until(condition, seconds: float = 60) -> bool:
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


# -- 2. no work without a client -------------------------------------------------------------------

def test_a_non_streamed_request_whose_client_hangs_up_is_cancelled_at_the_next_round(generator, monkeypatch):
    port = free_port()
    app = create_app(generator, NAME, AppOptions(max_batch=4))
    scheduler = app.state.scheduler
    server = run_in_thread(app, port)
    taken: list[Job] = []
    take = Job.take

    def slow_take(job, tokens, *args):  # after its first round the row waits until the hang-up is seen,
        taken.append(job)               # so that it cannot end first on a loaded machine
        deadline = time.time() + 30
        while job.tokens and not job.cancelled and time.time() < deadline:
            time.sleep(0.01)
        return take(job, tokens, *args)

    monkeypatch.setattr(Job, "take", slow_take)
    try:
        before = scheduler.cancelled_rows
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(request_bytes("/v1/chat/completions", json.dumps(
                chat("while True:", max_tokens=200)).encode()))
            assert until(lambda: any(job.tokens for job in taken))  # decoding: then hang up
        assert until(lambda: scheduler.cancelled_rows > before)
        job = taken[0]
        assert scheduler.cancelled_rows == before + 1
        assert job.cancelled and job.finish_reason == "cancelled" and len(job.tokens) < job.max_tokens
        assert until(lambda: any(key[1] == "499" for key in requests_counted(app)))
    finally:
        server.should_exit = True


def requests_counted(app) -> list[tuple]:
    """The (endpoint, status) pairs the app's request counter has seen."""
    return [tuple(sample.labels.values()) for metric in app.state.metrics.requests.collect()
            for sample in metric.samples if sample.name.endswith("_total")]


def test_a_non_streamed_request_answered_whole_is_not_cancelled(generator):
    with TestClient(create_app(generator, NAME)) as client:
        scheduler = client.app.state.scheduler
        r = client.post("/v1/completions", json=text())
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert scheduler.cancelled_rows == 0


# -- 3. timeouts and a bound on connections -----------------------------------------------------------

def status_of(port: int, data: bytes) -> tuple[int, bytes]:
    """Send `data` (the rest never comes) and read the answer's status and what arrived of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            part = sock.recv(4096)
            if not part:
                break
            answer += part
    return int(answer.split(b" ")[1]), answer


def test_a_body_that_trickles_in_is_cut_with_a_408(generator):
    port = free_port()
    server = run_in_thread(create_app(generator, NAME, AppOptions(request_timeout=0.3)), port)
    try:
        body = json.dumps(text()).encode()
        status, answer = status_of(port, request_bytes("/v1/completions", body[:10], length=len(body)))
        assert status == 408
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_timeout"
        # chunked, one chunk and never the end
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
               b"Transfer-Encoding: chunked\r\n\r\n"
        assert status_of(port, head + f"{10:x}\r\n".encode() + body[:10] + b"\r\n")[0] == 408
        # a whole body is served
        assert status_of(port, request_bytes("/v1/completions", body))[0] == 200
    finally:
        server.should_exit = True


def test_serve_gives_uvicorn_its_keep_alive_timeout_and_a_bound_on_connections(generator, tmp_path,
                                                                             monkeypatch):
    import uvicorn

    import selfspec.checkpoint

    seen = {}
    monkeypatch.setattr(selfspec.checkpoint, "load_tuned", lambda *args, **kwargs: generator)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(kwargs, app=app))
    monkeypatch.setattr(generator, "prefix_cache", generator.prefix_cache)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["serve", str(tmp_path / "model"), "--keep-alive-timeout", "7", "--max-connections",
                         "33", "--request-timeout", "12", "--prefix-cache-mb", "0"]) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    # uvicorn's own bound counts idle keep-alive connections too: a backstop behind the server's 33 requests
    assert seen["timeout_keep_alive"] == 7 and seen["limit_concurrency"] == 2 * 33


def test_requests_past_max_connections_get_an_openai_503_and_health_still_answers():
    """Two requests in flight under a limit of one: the second is refused in OpenAI's shape (uvicorn's own
    limit would answer in plain text), /health is answered, and the first finishes."""
    import httpx

    from selfspec.serving.app import _Guard
    from selfspec.serving.prometheus import Metrics

    release = asyncio.Event()

    async def slow(scope, receive, send):  # a request that holds its place until released
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario():
        guard = _Guard(slow, Metrics(), max_requests=1)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://x") as client:
            first = asyncio.create_task(client.get("/slow"))
            while guard.in_flight < 1:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json={})
            health = await client.get("/health")
            release.set()
            return refused, health, await first, guard.in_flight

    refused, health, first, in_flight = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "overloaded" and error["type"] == "server_error"
    assert "--max-connections" in error["message"]
    assert health.status_code == 200 and first.status_code == 200 and first.text == "ok"
    assert in_flight == 0


# -- 4. nothing heavy on the event loop ---------------------------------------------------------------

def on_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def heavy_calls(generator, monkeypatch):
    """Every template, tokenization and grammar compilation as (what, on an event loop's thread)."""
    calls = []
    chat_prompt, tokenize, compiled = generator.chat_prompt, type(generator.tokenizer).__call__, \
        GrammarTokenizer.compiled

    def recording(what, work):
        def wrapper(*args, **kwargs):
            calls.append((what, on_an_event_loop()))
            return work(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(generator, "chat_prompt", recording("template", chat_prompt))
    monkeypatch.setattr(type(generator.tokenizer), "__call__", recording("tokens", tokenize))
    monkeypatch.setattr(GrammarTokenizer, "compiled", recording("grammar", compiled))
    return calls


def test_templates_tokens_and_grammars_run_off_the_event_loop(generator, heavy_calls):
    schema = {"type": "object", "properties": {"off_the_loop": {"type": "integer"}},
              "required": ["off_the_loop"]}
    with TestClient(create_app(generator, NAME)) as client:
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200
        assert client.post("/v1/completions", json=text()).status_code == 200
        r = client.post("/v1/chat/completions", json=chat(max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
        assert r.status_code == 200
    assert {what for what, _ in heavy_calls} == {"template", "tokens", "grammar"}
    assert not any(on_loop for _, on_loop in heavy_calls), heavy_calls


def test_the_cheap_checks_come_before_any_heavy_work(generator, heavy_calls):
    with TestClient(create_app(generator, NAME, AppOptions(api_key="k", max_tokens_cap=10))) as client:
        key = {"Authorization": "Bearer k"}
        assert client.post("/v1/chat/completions", json=chat()).status_code == 401
        assert client.post("/v1/completions", content=json.dumps(text()),
                           headers={**key, "content-type": "text/plain"}).status_code == 415
        assert client.post("/v1/completions", json=text(temperature=5), headers=key).status_code == 400
        r = client.post("/v1/chat/completions", json=chat(max_tokens=11), headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = client.post("/v1/chat/completions", json=chat(max_completion_tokens=11), headers=key)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        assert client.post("/v1/completions", json=text(model="other"), headers=key).status_code == 400
    assert heavy_calls == []


def test_a_requests_grammar_is_compiled_once_not_again_by_each_wave(generator, monkeypatch):
    """Once, and on a thread that ends (not a pool thread, which would keep the stack a deep schema's
    compilation recursed through)."""
    compiles, threads = [], []
    matcher = GrammarTokenizer.matcher

    def counting(self, constraint):
        compiles.append(constraint)
        threads.append(threading.current_thread())
        return matcher(self, constraint)

    monkeypatch.setattr(GrammarTokenizer, "matcher", counting)
    schema = {"type": "object", "properties": {"compiled_once": {"type": "boolean"}},
              "required": ["compiled_once"]}
    body = chat(max_tokens=30, response_format={"type": "json_schema",
                                                "json_schema": {"name": "n", "schema": schema}})
    with TestClient(create_app(generator, NAME)) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(compiles) == 1  # off the event loop as the request was checked; the wave reused it
        assert not threads[0].is_alive() and not threads[0].name.startswith("selfspec-prep")
        # an idle server forgets it (a short schema can compile to tens of MiB): the next one compiles anew
        assert until(lambda: generator.grammar_tokenizer().kept == 0)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    assert len(compiles) == 2
