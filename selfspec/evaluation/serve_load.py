"""`selfspec eval serve-load`: the server under load, against itself without drafting and against
in-process `generate`.

The server is `selfspec serve` in its own process, as a user runs it (127.0.0.1, `server_process`);
clients are threads of this process that stream text completions over HTTP. For each concurrency
level (1, 2, 4, 8 by default) and each arm (the checkpoint's own settings; a second server without
drafting: plain decoding) the clients send `--requests` requests from the prompt set, greedy or sampled
as `--temperature`, `--top-p`, `--top-k` say (prompt i's requests seeded with `--seed` + i), the arms
interleaved level by level. Per level and arm it reports
throughput (generated tokens per second of wall time), time to the first token and inter-token
latency (a request's time from its first to its last chunk over its tokens after the first; p50,
p95), errors, and mismatches: replies that differ from the same prompt decoded alone in-process (sampled:
the same seeded draw, which a row keeps in any batch at a fixed k; an adaptive k or copies follow the
batch, so there a sampled reply keeps its distribution, not its seed's tokens).
The server's own cost is measured apart, paired (`_paired_speedup`): each prompt decoded by in-process
`generate` and requested from the server by one client, in alternating order, twice over the prompts,
once streamed and once in one response; the server's speedup over the server without drafting is
paired the same way. The median of the paired speed ratios and its interval
(`paired.median_interval`) survive the machine's drifts, which two rates timed a minute apart do not.

`--fault N` then sends N requests, a third of them malformed or hostile (bad JSON, a wrong key,
unknown fields' values, oversize bodies, huge max_tokens), mixed with good ones: every bad one
must get a 4xx, every good one its reply, and the server process's resident memory is compared
before and after. Then each fault class of FAULT_CLASSES (`--fault-classes`) in turn: its hostile requests,
each over a socket of its own (raw HTTP/1.1, as httpx cannot send a body that is not UTF-8, a chunk size
that is not hex or a request trickled over seconds), beside good requests and a /health probe. Per class:
the statuses, the 5xx (hostile, good and /health ones), errors whose body is not OpenAI's JSON, statuses
the class did not expect, the good replies changed (not the text decoded alone) or failed, /health's
p50 and p99, and the server's resident memory before and after. Every loop is bounded in count and
time; all traffic goes to 127.0.0.1.

    selfspec eval serve-load --model runs/demo/model --requests 16 --max-tokens 64
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path

import httpx

from ..checkpoint import load_tuned
from ..decoding import SelfSpecGenerator
from ..decoding.prefix import prefix_cache_of
from ..decoding.settings import PLAIN
from ..errors import UserError
from ..flags import to_cli_args
from ..serving.options import ServeOptions
from ..serving.scheduler import IDLE_RELEASE_SECONDS
from .options import ServeLoadOptions
from .paired import median_interval
from .prompts import read_prompts
from .report import publish, pyplot, save_figure
from .results import ServeLoadReport

KEY = "serve-load"
SETTLE_SECONDS = IDLE_RELEASE_SECONDS + 0.5  # after a fault class: the server has released what it freed
ARMS = ("selfspec", "plain")
PLAIN_FLAGS = {"drafter": "early_exit", "num_speculations": 0}  # `selfspec serve` without drafting
STARTUP_POLLS = 3000  # looks at /health, 0.1 s apart at least, before a server that never answers fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(options: ServeOptions, log: Path) -> Iterator[tuple[str, int]]:
    """`selfspec serve` with `options` (its flags: `options.to_cli_args`) in a process of its own on a
    free port of 127.0.0.1, under the name "served" with this module's key; yields (its /v1 URL, its
    pid) once it answers, and stops it with SIGTERM at the end. Its output goes to `log`.

    Why a process: two threads of one process that both decode each run an OpenMP team, and libgomp
    then has more threads than CPUs and lets every team's workers sleep between parallel regions (its
    throttled spin); decoding in this process beside a server thread ran several times slower, both
    of them. A process per server is also what its users run."""
    port = _free_port()
    options = replace(options, host="127.0.0.1", port=port, api_key=KEY, served_model_name="served")
    model = options.model
    command = [sys.executable, "-m", "selfspec", "serve", *to_cli_args(options)]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, "SELFSPEC_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(STARTUP_POLLS):  # the import, the load and the first build of the kernels
            if process.poll() is not None:
                raise UserError(f"`selfspec serve {model}` exited with {process.returncode} before it "
                                f"answered: see {log}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            raise UserError(f"`selfspec serve {model}` did not answer on port {port}: see {log}")
        yield f"{url}/v1", process.pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


_clients = threading.local()


def _client() -> httpx.Client:
    """This thread's HTTP client: one connection kept alive, as a real client keeps it (a new
    client per request would time its own setup, tens of ms, as the server's latency)."""
    if not hasattr(_clients, "http"):
        _clients.http = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {KEY}"})
    return _clients.http


def _stream(url: str, prompt: str, max_tokens: int, fields: dict | None = None) -> dict:
    """One streamed completion, greedy or with the sampling `fields`: its text, tokens, time to the first
    chunk and chunk times."""
    body = {"model": "served", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **(fields or {"temperature": 0})}
    start, times, text, usage = time.perf_counter(), [], [], None
    with _client().stream("POST", f"{url}/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}"}
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    times.append(time.perf_counter() - start)
                    text.append(choice["text"])
    tokens = usage["completion_tokens"] if usage else 0
    return {"text": "".join(text), "tokens": tokens, "first": times[0] if times else float("nan"),
            "inter_token": (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None}


def _level(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
           reference: list[str], fields=lambda i: None) -> dict:
    """`requests` requests from `concurrency` clients, prompt i's with the sampling `fields(i)`; the
    level's figures."""
    order = [i % len(prompts) for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: _stream(url, prompts[i], max_tokens, fields(i)), order))
    wall = time.perf_counter() - start
    good = [r for r in results if "error" not in r]
    mismatches = sum(r["text"] != reference[i] for i, r in zip(order, results) if "error" not in r)
    gaps = [r["inter_token"] for r in good if r["inter_token"] is not None]
    firsts = [r["first"] for r in good]
    return {"concurrency": concurrency, "requests": requests, "seconds": wall,
            "tokens_per_second": sum(r["tokens"] for r in good) / wall,
            "errors": len(results) - len(good), "mismatches": mismatches,
            "first_token_p50": _percentile(firsts, 0.5), "first_token_p95": _percentile(firsts, 0.95),
            "inter_token_p50": _percentile(gaps, 0.5), "inter_token_p95": _percentile(gaps, 0.95)}


def _complete(url: str, prompt: str, max_tokens: int, fields: dict | None = None) -> dict:
    """One completion in one response (no stream), greedy or with the sampling `fields`: its text, or
    the error."""
    response = _client().post(f"{url}/completions", json={"model": "served", "prompt": prompt,
                                                           "max_tokens": max_tokens,
                                                           **(fields or {"temperature": 0})})
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}"}
    return {"text": response.json()["choices"][0]["text"]}


def _paired_speedup(run, baseline, count: int, passes: int = 2) -> dict:
    """Items 0 .. count - 1 each run by `baseline` and by `run` (callables of the item's index) one
    after the other, the order alternating, `passes` times over: the median of (baseline seconds ÷ run
    seconds), `run`'s speed as a multiple of `baseline`'s, and its interval. Two rates timed a minute
    apart differ by the machine's drift; paired ones do not."""
    ratios = []
    for index in range(passes * count):
        seconds = {}
        for name, timed in [("run", run), ("baseline", baseline)][::1 if index % 2 else -1]:
            start = time.perf_counter()
            timed(index % count)
            seconds[name] = time.perf_counter() - start
        ratios.append(seconds["baseline"] / seconds["run"])
    return median_interval(ratios)


def _resident_bytes(pid: int) -> int:
    """Process `pid`'s resident memory (psutil; else Linux /proc; else 0)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    except Exception:  # psutil.Error: no such process, no access
        return 0
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def fault_run(url: str, prompts: list[str], reference: list[str], total: int, max_tokens: int,
              pid: int = 0, seed: int = 0, classes: list[str] | None = None, scale: float = 1.0) -> dict:
    """`total` requests, a third bad (each kind in turn), the rest good; which got what, and the
    resident memory of the server's process `pid` before and after. A good one counts as answered when
    its text is `reference`'s for its prompt (decoded alone). Then each fault class (`fault_classes`:
    `classes`, None: all) beside max(2, total // 8) good requests: its row under "classes"."""
    rng = random.Random(seed)
    auth = {"Authorization": f"Bearer {KEY}"}
    bad_kinds = {
        "not json": dict(content=b"{\"model\": ", headers={**auth, "content-type": "application/json"}),
        "wrong key": dict(json={"model": "served", "prompt": "x"}, headers={"Authorization": "Bearer nope"}),
        "no key": dict(json={"model": "served", "prompt": "x"}, headers={}),
        "n = 3": dict(json={"model": "served", "prompt": "x", "n": 3}, headers=auth),
        "huge max_tokens": dict(json={"model": "served", "prompt": "x", "max_tokens": 10**9}, headers=auth),
        "unknown model": dict(json={"model": "gpt-9", "prompt": "x"}, headers=auth),
        "oversize body": dict(json={"model": "served", "prompt": "x" * (2 << 20)}, headers=auth),
        "wrong types": dict(json={"model": "served", "prompt": {"a": 1}, "temperature": "hot"}, headers=auth),
    }
    plan = [("good", rng.randrange(len(prompts))) if rng.random() > 1 / 3 else
            (list(bad_kinds)[i % len(bad_kinds)], None) for i in range(total)]
    before = _resident_bytes(pid)

    def send(entry: tuple) -> tuple[str, int, bool]:
        kind, i = entry
        if kind == "good":
            r = httpx.post(f"{url}/completions", headers=auth, timeout=600, json={
                "model": "served", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0})
            right = r.status_code == 200 and r.json()["choices"][0]["text"] == reference[i]
            return kind, r.status_code, right
        r = httpx.post(f"{url}/completions", timeout=60, **bad_kinds[kind])
        return kind, r.status_code, False

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, plan))
    bad = [(k, code) for k, code, _ in results if k != "good"]
    good = [right for k, _, right in results if k == "good"]
    after = _resident_bytes(pid)
    rows = fault_classes(url, prompts, reference, max_tokens, pid, classes=classes, good=max(2, total // 8),
                         scale=scale) if classes != [] else []
    return {"requests": total, "bad": len(bad), "bad_refused_4xx": sum(400 <= c < 500 for _, c in bad),
            "bad_codes": sorted({f"{k}: {c}" for k, c in bad}), "good": len(good),
            "good_ok": sum(good), "resident_before": before, "resident_after": after,
            "resident_end": rows[-1]["resident_after"] if rows else after, "classes": rows}


# -- fault classes: hostile traffic of one kind beside good requests ----------------------------------

FAULT_CLASSES = ("numeric overflow", "hang-ups", "abandoned flood", "oversized and chunked bodies",
                 "slowloris", "wrong content types", "invalid utf-8", "deep json", "pathological schemas",
                 "huge stop strings", "bad role orders")
RAW_SECONDS = 60  # the most one hostile request may take, all of it; beyond: "timeout"
SLOWLORIS_SECONDS = 3.0  # a trickled request's whole time (scaled): bounded, then it ends or hangs up
HEALTH_EVERY, HEALTH_PROBES = 0.05, 2000  # /health probed this often during a class, at most this often
BODY_OVER = 2 << 20  # bigger than `selfspec serve`'s default --max-body-bytes (1 MiB)
RAW = "\x00raw\x00"  # a value written into the JSON text as it is (NaN, 1e400, an escape)


def _raw_json(body: dict, raw: str) -> bytes:
    """`body` as JSON with its one RAW value replaced by the text `raw` (NaN, 1e400, \\ud800)."""
    return json.dumps(body).replace(json.dumps(RAW), raw).encode()


def _text(**fields) -> dict:
    return {"model": "served", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, **fields}


def _chat(messages: list, **fields) -> dict:
    return {"model": "served", "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


@dataclass
class Attack:
    """One hostile request, sent over a socket of its own (`_send`): the body's bytes (a list: parts,
    each a chunk when `chunked`), what to expect ("4xx", "2xx", "any": a status under 500, "none": we
    hang up first) and how to send it: a Content-Length of `length` instead of the body's, the chunked
    body without its `end`, hung up `hang_up` ("sent": once sent, "first": at the answer's head) after
    `linger` seconds, trickled over `trickle` seconds and cut at the `stop_at` share of it."""

    body: bytes | list[bytes] | dict
    expect: str = "4xx"
    _: KW_ONLY
    path: str = "/v1/completions"
    content_type: str | None = "application/json"
    chunked: bool = False
    length: int | None = None
    end: bool = True
    hang_up: str | None = None
    linger: float = 0.0
    trickle: float = 0.0
    stop_at: float = 1.0
    label: str | None = None
    parts: list[bytes] = field(init=False)

    def __post_init__(self):
        body = json.dumps(self.body).encode() if isinstance(self.body, dict) else self.body
        self.parts = [body] if isinstance(body, bytes) else body
        whole = b"".join(self.parts)
        self.label = self.label or (f"{self.path} {self.content_type} "
                                    + whole[:70].decode("utf-8", "backslashreplace")
                                    + ("..." if len(whole) > 70 else ""))

    def request(self) -> bytes:
        head = [f"POST {self.path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {KEY}",
                "Connection: close"]
        if self.content_type is not None:
            head.append(f"Content-Type: {self.content_type}")
        if self.chunked:
            head.append("Transfer-Encoding: chunked")
            body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in self.parts)
            body += b"0\r\n\r\n" if self.end else b""
        else:
            body = b"".join(self.parts)
            head.append(f"Content-Length: {len(body) if self.length is None else self.length}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _parse_answer(answer: bytes) -> tuple[int | str, bool]:
    """(the status, whether an error's body is OpenAI's JSON) of a whole HTTP/1.1 answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return "no answer", True
    if b"transfer-encoding: chunked" in head.lower():
        whole, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            try:
                n = int(size.split(b";")[0], 16)
            except ValueError:
                break
            if n == 0:
                break
            whole, rest = whole + rest[:n], rest[n + 2:]
        body = whole
    if status < 400:
        return status, True
    try:
        error = json.loads(body)["error"]
        shaped = isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
    except (ValueError, KeyError, TypeError):
        shaped = False
    return status, shaped


async def _send(port: int, attack: Attack) -> tuple[int | str, bool]:
    """Send `attack` to 127.0.0.1:`port` and read its answer to the end (the server closes after it:
    Connection: close); (status, whether an error body is OpenAI's JSON). The status is a word when none
    came: "hung up" (we closed first, as told), "no answer" (the server closed), "timeout"."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return "refused", True
    data = attack.request()
    pieces = 16 if attack.trickle else 1
    step = -(-len(data) // pieces)
    last = pieces if attack.stop_at >= 1 else max(1, int(pieces * attack.stop_at))

    async def exchange():
        try:
            for i in range(last):
                if i:
                    await asyncio.sleep(attack.trickle / pieces)
                writer.write(data[i * step:(i + 1) * step])
                await writer.drain()
        except OSError:
            pass  # the server answered (a 413) and closed before the rest: read what it said
        if last < pieces or attack.hang_up == "sent":
            await asyncio.sleep(attack.linger)
            return "hung up", True
        answer = b""
        try:
            while len(answer) < 1 << 22:
                part = await reader.read(65536)
                if not part:
                    break
                answer += part
                if attack.hang_up == "first" and b"\r\n\r\n" in answer:
                    status, _ = _parse_answer(answer)  # the head came; the stream is left mid-way
                    return f"{status}, hung up", True
        except OSError:
            pass
        return _parse_answer(answer)

    try:
        return await asyncio.wait_for(exchange(), RAW_SECONDS)
    except asyncio.TimeoutError:
        return "timeout", True
    finally:
        writer.close()


def _count(count: int, scale: float) -> int:
    """`count` times `scale`, at least 1."""
    return max(1, round(count * scale))


CHAT_PATH = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _numeric_overflow(scale: float, max_tokens: int) -> list[Attack]:
    return [Attack(_text(seed=2**63, temperature=1)), Attack(_text(seed=-2**63 - 1, temperature=1)),
            Attack(_text(max_tokens=2**63)), Attack(_text(max_tokens=10**30)),
            Attack(_chat(USER, max_completion_tokens=2**64), path=CHAT_PATH),
            Attack(_text(top_k=2**70)), Attack(_text(n=2**63)), Attack(_text(logprobs=-2**63))] + [
        Attack(_raw_json(_text(**{field: RAW}), raw)) for field, raw in [
            ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "-Infinity"),
            ("max_tokens", "1e400"), ("seed", "1e309"), ("presence_penalty", "NaN"),
            ("max_tokens", "9" * 400)]]


def _hang_ups(scale: float, max_tokens: int) -> list[Attack]:
    """Streamed: the head and the first chunks, then we close; not streamed: before the answer."""
    long = max_tokens * 4
    return [Attack(_text(max_tokens=long, stream=True), "none", hang_up="first")
            for _ in range(_count(4, scale))] + [
        Attack(_text(max_tokens=long), "none", hang_up="sent", linger=0.2)
        for _ in range(_count(4, scale))] + [
        Attack(_chat(USER, max_tokens=long, stream=True), "none", path=CHAT_PATH, hang_up="first")
        for _ in range(_count(2, scale))]


def _abandoned_flood(scale: float, max_tokens: int) -> list[Attack]:
    """Fire and forget: the connection closes once the request is sent."""
    return [Attack(_text(prompt=f"# {i}\ndef f(x):", max_tokens=max_tokens * 4), "none", hang_up="sent")
            for i in range(_count(32, scale))]


def _oversized_and_chunked_bodies(scale: float, max_tokens: int) -> list[Attack]:
    big = json.dumps(_text(prompt="x" * BODY_OVER)).encode()
    good = json.dumps(_text()).encode()
    return [Attack(b"", length=10**9), Attack(big),  # a declared length over the limit; a body over it
            Attack([big[i:i + 65536] for i in range(0, len(big), 65536)], chunked=True),
            Attack([big[:BODY_OVER // 2 + 1], big[BODY_OVER // 2 + 1:]], chunked=True, end=False),
            Attack([good[:7], good[7:20], good[20:]], "2xx", chunked=True),  # chunked within the limit
            Attack([b"zz\r\n"], chunked=True),  # a chunk size that is not hex
            Attack(good, "none", length=len(good) * 2, hang_up="sent", linger=0.5)]  # never all of it


def _slowloris(scale: float, max_tokens: int) -> list[Attack]:
    """The request trickled over a few seconds; half finish, half give up half-way."""
    seconds = SLOWLORIS_SECONDS * min(1.0, scale) if scale < 1 else SLOWLORIS_SECONDS
    return [Attack(_text(prompt=f"# slow {i}\ndef f(x):"), "2xx" if i % 2 == 0 else "none",
                   trickle=seconds, stop_at=1.0 if i % 2 == 0 else 0.5)
            for i in range(max(2, _count(8, scale)))]


def _wrong_content_types(scale: float, max_tokens: int) -> list[Attack]:
    body = json.dumps(_text()).encode()
    kinds = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
             "application/xml", "text/json")
    return [Attack(body, "4xx", path=path, content_type=kind) for path in ("/v1/completions", CHAT_PATH)
            for kind in kinds] + [
        Attack(b"model=served&prompt=hi", content_type="application/x-www-form-urlencoded")]


def _invalid_utf8(scale: float, max_tokens: int) -> list[Attack]:
    start = b'{"model": "served", "max_tokens": 4, "prompt": "'
    chat_start = b'{"model": "served", "max_tokens": 4, "messages": [{"role": "user", "content": "'
    bad_bytes = (b"\xff\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"ok\x80ok", b"\xf8\x88\x80\x80\x80")
    return [Attack(start + bad + b'"}') for bad in bad_bytes] + [
        Attack(chat_start + b"\xff" + b'"}]}', path=CHAT_PATH)] + [
        # a lone surrogate, escaped: valid JSON text, not a valid string of text
        Attack(_raw_json(_text(prompt=RAW), raw), "any") for raw in ('"\\ud800"', '"a\\udfffb"')] + [
        Attack(_raw_json(_chat([{"role": "user", "content": RAW}]), '"\\ud83d"'), "any", path=CHAT_PATH),
        Attack(_raw_json(_text(stop=RAW), '"\\udc00"'), "any")]


def _deep_json(scale: float, max_tokens: int) -> list[Attack]:
    depth = max(100, round(10_000 * min(1.0, scale * 4)))
    arrays = ("[" * depth + "]" * depth).encode()
    objects = '{"a": ' * depth + "1" + "}" * depth
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    return [Attack(b'{"model": "served", "prompt": ' + arrays + b"}"),
            Attack(_raw_json(_text(metadata=RAW), objects)),
            Attack(_raw_json(_chat([{"role": "user", "content": RAW}]), "[" * depth + "]" * depth),
                   path=CHAT_PATH),
            Attack(_raw_json(_text(response_format={"type": "json_schema", "json_schema": {
                "name": "deep", "schema": RAW}}), schema), "any"),
            Attack(arrays)]


def _pathological_schemas(scale: float, max_tokens: int) -> list[Attack]:
    """Each compiles or is refused in one bounded step; decodes 4 tokens."""
    def schema(s: dict) -> Attack:
        text = json.dumps(s)
        return Attack(_text(prompt="a value: ", response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": s}}), "any",
            label="schema " + text[:80] + ("..." if len(text) > 80 else ""))
    count = _count(20_000, scale)
    return [schema(s) for s in (
        {"type": "string", "pattern": "^(a+)+$"}, {"type": "string", "pattern": "^(a|aa)*b$"},
        {"type": "string", "pattern": "^((a*)*)*b$"}, {"type": "string", "pattern": "^a{1000000}$"},
        {"type": "string", "pattern": "^(a{1,1000}){1,1000}$"}, {"type": "string", "pattern": "(?=a)b"},
        {"type": "string", "pattern": "["}, {"type": "string", "minLength": 10**9},
        {"type": "array", "items": {"type": "integer"}, "minItems": 10**9},
        {"type": "string", "enum": [f"value {i}" for i in range(count)]},
        {"type": "integer", "minimum": 10, "maximum": 1},
        {"type": "string", "minLength": 5, "maxLength": 1},
        {"type": "number", "multipleOf": 1e-300}, {"not": {}}, {"$ref": "#"},
        {"$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                         "required": ["a"]}}, "$ref": "#/$defs/a"},
        {"$ref": "#/$defs/missing"}, {"type": "object", "required": [f"k{i}" for i in range(count)]},
        {"allOf": [{"type": "string"}, {"type": "integer"}]})]


def _huge_stop_strings(scale: float, max_tokens: int) -> list[Attack]:
    chars = max(1000, round(200_000 * min(1.0, scale)))
    return [Attack(_text(stop="x" * chars)), Attack(_text(stop=["x" * chars] * 4)),
            Attack(_text(stop=[f"s{i}" for i in range(_count(10_000, scale))])),
            Attack(_text(stop="x" * 257)),
            Attack(_chat(USER, stop="y" * chars), path=CHAT_PATH), Attack(_text(stop={"a": 1})),
            Attack(_text(stop="x" * 256), "2xx"), Attack(_text(stop=["\n" * 256, "é" * 256]), "2xx")]


def _bad_role_orders(scale: float, max_tokens: int) -> list[Attack]:
    m = lambda role, content="hi": {"role": role, "content": content}  # noqa: E731
    orders = [[], [m("assistant")], [m("user"), m("user")], [m("system"), m("system")],
              [m("assistant"), m("user")], [m("user"), m("assistant")], [m("system")], [m("tool")],
              [m("user"), m("system"), m("user")], [m("developer"), m("assistant"), m("assistant")],
              [{"role": "user"}], [m("user", None)], [m("user", [])],
              [m("user", [{"type": "image_url", "image_url": {"url": "x"}}])], [m("function")],
              [m("user")] * _count(200, scale)]
    return [Attack(_chat(messages), "any", path=CHAT_PATH, label="messages " + json.dumps(messages)[:80])
            for messages in orders]


ATTACKS = dict(zip(FAULT_CLASSES, (
    _numeric_overflow, _hang_ups, _abandoned_flood, _oversized_and_chunked_bodies, _slowloris,
    _wrong_content_types, _invalid_utf8, _deep_json, _pathological_schemas, _huge_stop_strings,
    _bad_role_orders), strict=True))  # each fault class's hostile requests


def _attacks(name: str, scale: float, max_tokens: int) -> list[Attack]:
    """The hostile requests of fault class `name`; counts and sizes times `scale` (1: the full sizes)."""
    if name not in ATTACKS:
        raise UserError(f"no fault class {name!r}; the classes: {', '.join(FAULT_CLASSES)}")
    return ATTACKS[name](scale, max_tokens)


def _server_error(status: int | str) -> bool:
    """Whether `status` ("500" or "500, hung up" too) is a 5xx."""
    return str(status)[:1] == "5"


def _expected(expect: str, status: int | str) -> bool:
    if expect == "none":
        return True  # we hung up: whatever came
    if not isinstance(status, int):
        return False
    return {"4xx": 400 <= status < 500, "2xx": 200 <= status < 300, "any": status < 500}[expect]


def _queue_drained(base: str) -> int | None:
    """The server's waiting requests once none are left (the abandoned ones gone or decoded), or after
    10 s; None when /health did not answer."""
    waiting = None
    for _ in range(100):
        try:
            waiting = httpx.get(f"{base}/health", timeout=10).json().get("waiting")
        except (httpx.HTTPError, ValueError):
            return None
        if not waiting:
            return waiting
        time.sleep(0.1)
    return waiting


def _prefix_cache_bytes(base: str) -> int | None:
    """The bytes of keys and values the server's prefix cache holds (its /metrics), a cache bounded by
    --prefix-cache-mb that a server's resident memory includes; None when /metrics did not answer."""
    try:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    except httpx.HTTPError:
        return None
    return next((int(float(line.split()[1])) for line in text.splitlines()
                 if line.startswith("selfspec_prefix_cache_bytes ")), None)


def _fault_class(name: str, url: str, prompts: list[str], reference: list[str], good: int, max_tokens: int,
                 pid: int, scale: float, settle: float) -> dict:
    """Fault class `name`'s hostile requests, `good` good ones (streamed and not, in turn) and a /health
    probe, all at once; the class's row. The server's resident memory before, right after, and
    `settle` seconds later (it releases what it freed once idle: `IDLE_RELEASE_SECONDS`)."""
    port = httpx.URL(url).port
    base = url.removesuffix("/v1")
    attacks = _attacks(name, scale, max_tokens)
    before = _resident_bytes(pid)
    done = threading.Event()

    def probe() -> tuple[list[float], list[int]]:
        seconds, codes = [], []
        with httpx.Client(timeout=30) as http:
            for _ in range(HEALTH_PROBES):
                start = time.perf_counter()
                try:
                    codes.append(http.get(f"{base}/health").status_code)
                    seconds.append(time.perf_counter() - start)
                except httpx.HTTPError:
                    codes.append(0)
                if done.wait(HEALTH_EVERY):
                    break
        return seconds, codes

    def good_one(k: int) -> tuple[int, str | None, int]:
        i = k % len(prompts)
        try:
            if k % 2:
                reply = _stream(url, prompts[i], max_tokens)
                return (200, reply["text"], i) if "error" not in reply else (int(reply["error"][5:]), None, i)
            reply = _complete(url, prompts[i], max_tokens)
            return (200, reply["text"], i) if "error" not in reply else (int(reply["error"][5:]), None, i)
        except (httpx.HTTPError, ValueError):
            return 0, None, i

    async def hostile() -> list[tuple[int | str, bool]]:
        limit = asyncio.Semaphore(64)

        async def one(attack):
            async with limit:
                return await _send(port, attack)
        return await asyncio.gather(*(one(a) for a in attacks))

    start = time.perf_counter()
    with ThreadPoolExecutor(2 + min(good, 4)) as pool:
        health = pool.submit(probe)
        hostile_run = pool.submit(asyncio.run, hostile())  # before the good ones: a worker of its own
        goods = [pool.submit(good_one, k) for k in range(good)]  # four at a time
        try:
            results = hostile_run.result()
            goods = [g.result() for g in goods]
        finally:
            done.set()
        seconds, health_codes = health.result()
    waiting = _queue_drained(base)
    peak = _resident_bytes(pid)
    time.sleep(settle)
    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    codes = [s for s, _ in results if isinstance(s, int)] + [s for s, _, _ in goods] + health_codes
    return {"class": name, "requests": len(attacks), "statuses": dict(sorted(statuses.items())),
            "server_errors": sum(c >= 500 for c in codes) + sum(
                _server_error(s) for s, _ in results if isinstance(s, str)),
            "plain_errors": sum(not shaped for _, shaped in results),
            "unexpected": sum(not _expected(a.expect, s) for a, (s, _) in zip(attacks, results)),
            "failures": [f"{a.label}: {s}" for a, (s, shaped) in zip(attacks, results)
                         if not shaped or not _expected(a.expect, s) or _server_error(s)][:20],
            "good": good, "good_failed": sum(code != 200 for code, _, _ in goods),
            "good_changed": sum(code == 200 and text != reference[i] for code, text, i in goods),
            "health_p50": _percentile(seconds, 0.5), "health_p99": _percentile(seconds, 0.99),
            "health_failed": sum(c != 200 for c in health_codes), "waiting_after": waiting,
            "seconds": time.perf_counter() - start,
            "resident_before": before, "resident_peak": peak, "resident_after": _resident_bytes(pid),
            "prefix_cache_after": _prefix_cache_bytes(base)}


def fault_classes(url: str, prompts: list[str], reference: list[str], max_tokens: int, pid: int = 0, *,
                  classes: list[str] | None = None, good: int = 4, scale: float = 1.0,
                  settle: float = SETTLE_SECONDS) -> list[dict]:
    """Each fault class in turn (`classes`; None: all of FAULT_CLASSES) beside `good` good requests and
    a /health probe; one row per class (`_fault_class`, its memory read again after `settle` idle
    seconds). `scale` shrinks the counts and sizes (tests)."""
    names = list(FAULT_CLASSES) if classes is None else classes
    unknown = [c for c in names if c not in FAULT_CLASSES]
    if unknown:
        raise UserError(f"no fault class {', '.join(map(repr, unknown))}; the classes: "
                        f"{', '.join(FAULT_CLASSES)}")
    return [_fault_class(name, url, prompts, reference, good, max_tokens, pid, scale, settle)
            for name in names]


def to_markdown(report: dict) -> str:
    lines = [f"# Server under load: {report['model']}", "",
             f"{report['requests']} streamed requests per level ({report.get('sampling', 'greedy')}; the "
             f"fault run's greedy), up to {report['max_tokens']} tokens "
             f"each, {report['num_prompts']} prompts, max batch {report['max_batch']}; in-process generate "
             f"at concurrency 1: {report['in_process_tokens_per_second']:.1f} tokens/s "
             f"({report['settings']}).", "",
             "| arm | concurrency | tokens/s | × concurrency 1 | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) "
             "| errors | mismatches |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        rows = report["levels"][arm]
        for row in rows:
            lines.append(f"| {arm} | {row['concurrency']} | {row['tokens_per_second']:.1f} | "
                         f"{row['tokens_per_second'] / rows[0]['tokens_per_second']:.2f} | "
                         f"{row['first_token_p50'] * 1e3:.0f} / {row['first_token_p95'] * 1e3:.0f} | "
                         f"{row['inter_token_p50'] * 1e3:.1f} / {row['inter_token_p95'] * 1e3:.1f} | "
                         f"{row['errors']} | {row['mismatches']} |")
    if report.get("sampling", "greedy") != "greedy":
        lines += ["", "Sampled: a mismatch is a seeded reply other than the prompt's decode alone in "
                      "process (an adaptive k or copies follow the batch, so there a reply keeps its "
                      "distribution, not its seed's tokens)."]
    served, whole = report["served_vs_in_process"], report["whole_vs_in_process"]
    lines += ["", f"One client, each prompt in process and served, in alternating order: the server runs at "
                  f"{served['speedup']:.2f}× in-process generate streamed ({served['low']:.2f}-"
                  f"{served['high']:.2f}, {served['coverage']:.0%}) and {whole['speedup']:.2f}× in one "
                  f"response ({whole['low']:.2f}-{whole['high']:.2f})."]
    ours, theirs = report["served_speedup"], report["in_process_speedup"]
    lines += [f"Paired the same way (each prompt by both, alternately): the server's speedup over the "
              f"server without drafting is {ours['speedup']:.2f}× ({ours['low']:.2f}-{ours['high']:.2f}); "
              f"in process {theirs['speedup']:.2f}× ({theirs['low']:.2f}-{theirs['high']:.2f})."]
    fault = report.get("fault")
    if fault:
        lines += ["", f"Fault run: {fault['requests']} requests; {fault['bad_refused_4xx']} of "
                      f"{fault['bad']} bad ones refused with a 4xx ({', '.join(fault['bad_codes'])}); "
                      f"{fault['good_ok']} of "
                      f"{fault['good']} good ones answered; resident memory "
                      f"{fault['resident_before'] / 2**20:.0f} -> {fault['resident_after'] / 2**20:.0f} MiB"
                      + (f", after every fault class, idle: {fault['resident_end'] / 2**20:.0f} MiB."
                         if fault.get("classes") else ".")]
        lines += fault_table(fault.get("classes") or [])
    return "\n".join(lines) + "\n"


def fault_table(rows: list[dict]) -> list[str]:
    """The fault classes' rows as Markdown lines (none: no lines)."""
    if not rows:
        return []
    lines = ["", "Fault classes, each beside good requests and a /health probe (statuses of the hostile "
                 "requests; \"hung up\": the client closed first, as the class does):", "",
             "| class | hostile | statuses | 5xx | plain-text errors | unexpected | good changed / failed "
             "| /health p50 / p99 (ms) | RSS before -> right after -> idle (MiB) | prefix cache (MiB) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        statuses = ", ".join(f"{k} ×{v}" for k, v in row["statuses"].items())
        lines.append(f"| {row['class']} | {row['requests']} | {statuses} | {row['server_errors']} | "
                     f"{row['plain_errors']} | {row['unexpected']} | "
                     f"{row['good_changed']} / {row['good_failed']} "
                     f"of {row['good']} | {row['health_p50'] * 1e3:.1f} / {row['health_p99'] * 1e3:.1f} | "
                     f"{row['resident_before'] / 2**20:.0f} -> {row['resident_peak'] / 2**20:.0f} -> "
                     f"{row['resident_after'] / 2**20:.0f} | {_mib(row['prefix_cache_after'])} |")
    return lines


def _mib(count: int | None) -> str:
    return "" if count is None else f"{count / 2**20:.0f}"


def plot(report: dict, path: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in ARMS:
        rows = report["levels"][arm]
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o",
                label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("selfspec serve under load")
    ax.legend()
    return save_figure(fig, path)


def serve_load(options: ServeLoadOptions) -> ServeLoadReport:
    """Run the load benchmark on `options.model` (see the module docstring); returns the report. Both
    servers and the in-process generators prefill through prefix caches of `prefix_cache_mb` MiB (0:
    none). fault_classes: a comma list of FAULT_CLASSES the fault run sends too ("all"; None or "": none).

        serve_load(ServeLoadOptions(model="runs/demo/model", concurrency="1,2", fault=12))
    """
    wanted = options.fault_classes
    classes = (list(FAULT_CLASSES) if wanted == "all" else
               [c.strip() for c in wanted.split(",") if c.strip()] if isinstance(wanted, str) else
               list(wanted or []))
    if set(classes) - set(FAULT_CLASSES):
        raise UserError(f"--fault-classes: no class {', '.join(sorted(set(classes) - set(FAULT_CLASSES)))}; "
                        f"the classes: {', '.join(FAULT_CLASSES)}")
    overrides = {k: v for k, v in options.overrides().items() if v is not None}
    device, max_tokens = options.device or "auto", options.max_tokens
    gen = load_tuned(options.model, device=device, dtype=options.dtype, **overrides)
    plain = SelfSpecGenerator(gen.model, gen.tokenizer, settings=PLAIN)
    for generator in (gen, plain):  # each its own, as each server has
        generator.prefix_cache = prefix_cache_of(options.prefix_cache_mb)
    texts = [gen.tokenizer.decode(ids) for ids in read_prompts(gen.tokenizer, options.prompts, options.corpus,
                                                               options.num_prompts)]
    ids = [list(gen.tokenizer(t)["input_ids"]) for t in texts]

    sampled = options.request_fields  # prompt i's sampling, as its requests carry it (generate's names)

    def in_process(generator, fields=sampled) -> tuple[float, list[str]]:
        start, tokens, replies = time.perf_counter(), 0, []
        for i, prompt in enumerate(ids):
            out = generator.generate([prompt], max_new_tokens=max_tokens, **fields(i))
            tokens += len(out.sequences[0])
            replies.append(gen.tokenizer.decode(out.sequences[0], skip_special_tokens=True))
        return tokens / (time.perf_counter() - start), replies

    in_process(gen)  # warm-up: kernels, caches
    rate, reference = in_process(gen)
    plain_rate, plain_reference = in_process(plain)
    if options.sampling().greedy and plain_reference != reference:
        raise UserError("plain and self-speculative decoding disagree in process; run the tests")
    # each arm's replies against its own decode alone (sampled, plain draws other tokens); the fault run's
    # requests are greedy
    references = {"selfspec": reference, "plain": plain_reference,
                  "fault": reference if options.sampling().greedy or not options.fault
                  else in_process(gen, lambda i: {"temperature": 0})[1]}

    def alone(generator):  # prompt i decoded in process by `generator`
        return lambda i: generator.generate([ids[i]], max_new_tokens=max_tokens, **sampled(i))

    speedup = _paired_speedup(alone(gen), alone(plain), len(ids))
    served = ServeOptions(model=options.model, max_batch=options.max_batch, device=device,
                          dtype=options.dtype, prefix_cache_mb=options.prefix_cache_mb, **options.overrides())
    report = {"model": options.model, "settings": gen.settings.describe(), "requests": options.requests,
              "sampling": options.sampling().describe(),
              "max_tokens": max_tokens, "num_prompts": len(texts), "max_batch": options.max_batch,
              "in_process_tokens_per_second": rate, "in_process_plain_tokens_per_second": plain_rate,
              "in_process_speedup": speedup}
    report.update(_served(served, options, texts, references, alone(gen), classes))
    publish(options.out, "serve_load", report, to_markdown(report), plot)
    return report


def _served(served: ServeOptions, options: ServeLoadOptions, texts: list[str], references: dict,
            in_process, classes: list[str]) -> dict:
    """The two servers' part of the report: `served` and the same without drafting, each in a process
    of its own; `in_process` decodes prompt i in this process (the server's own cost is paired with it);
    `references`: each arm's replies decoded alone in process, and the fault run's (greedy)."""
    logs, max_tokens = Path(options.out), options.max_tokens
    with (server_process(served, logs / "server.log") as (url, pid),
          server_process(replace(served, **PLAIN_FLAGS), logs / "server-plain.log") as (plain_url, _)):
        urls = {"selfspec": url, "plain": plain_url}
        # Warm-up: every prompt once to each server, as the in-process generators had every prompt
        # (their rate above): a prefix cache that holds a prompt prefills it in a fraction of the
        # time, so a server that had one prompt would pay a prefill the in-process call does not.
        fields = options.request_fields
        for arm in ARMS:
            _level(urls[arm], texts, 1, len(texts), max_tokens, references[arm], fields)

        def asked(way, at):  # prompt i requested from the server at `at` by one client
            return lambda i: way(at, texts[i], max_tokens, fields(i))

        # the server's own cost at one client (streamed, and in one response), and its speedup
        streamed = _paired_speedup(asked(_stream, url), in_process, len(texts))
        whole = _paired_speedup(asked(_complete, url), in_process, len(texts))
        served_speedup = _paired_speedup(asked(_stream, url), asked(_stream, plain_url), len(texts))
        results = {arm: [] for arm in ARMS}
        for level in options.concurrency:  # the arms interleaved level by level
            for arm in ARMS:
                results[arm].append(_level(urls[arm], texts, level, options.requests, max_tokens,
                                           references[arm], fields))
        fault_report = fault_run(url, texts, references["fault"], options.fault, max_tokens, pid,
                                 classes=classes) if options.fault else None
    return {"served_speedup": served_speedup, "served_vs_in_process": streamed, "whole_vs_in_process": whole,
            "levels": results, "fault": fault_report}
