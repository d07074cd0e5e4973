"""`selfspec eval serve-load`: the server under load, against itself without drafting and against
in-process `generate`.

The server is `selfspec serve` in its own process, as a user runs it (127.0.0.1, `server_process`);
clients are threads of this process that stream text completions over HTTP. For each concurrency
level (1, 2, 4, 8 by default) and each arm (the checkpoint's own settings; a second server without
drafting: plain decoding) the clients send `--requests` greedy requests from the prompt set, the arms
interleaved level by level. Per level and arm it reports
throughput (generated tokens per second of wall time), time to the first token and inter-token
latency (a request's time from its first to its last chunk over its tokens after the first; p50,
p95), errors, and mismatches: replies that differ from the same prompt decoded alone in-process.
The server's own cost is measured apart, paired (`_paired_speedup`): each prompt decoded by in-process
`generate` and requested from the server by one client, in alternating order, twice over the prompts,
once streamed and once in one response; the server's speedup over the server without drafting is
paired the same way. The median of the paired speed ratios and its interval
(`paired.median_interval`) survive the machine's drifts, which two rates timed a minute apart do not.

`--fault N` then sends N requests, a third of them malformed or hostile (bad JSON, a wrong key,
unknown fields' values, oversize bodies, huge max_tokens), mixed with good ones: every bad one
must get a 4xx, every good one its reply, and the server process's resident memory is compared
before and after.

    selfspec eval serve-load --model runs/demo/model --requests 16 --max-tokens 64
"""

from __future__ import annotations

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
from pathlib import Path

import httpx

from ..decoding import SelfSpecGenerator
from ..decoding.prefix import prefix_cache_of
from ..decoding.settings import PLAIN
from ..errors import UserError
from .benchmark import read_prompts
from .paired import median_interval
from .report import publish, save_figure
from .results import ServeLoadReport

KEY = "serve-load"
ARMS = ("selfspec", "plain")
PLAIN_FLAGS = {"drafter": "early_exit", "num_speculations": 0}  # `selfspec serve` without drafting
STARTUP_POLLS = 3000  # looks at /health, 0.1 s apart at least, before a server that never answers fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(model: str, log: Path, *, max_batch: int = 8, device: str = "auto", dtype: str = "auto",
                   **settings) -> Iterator[tuple[str, int]]:
    """`selfspec serve MODEL` in a process of its own on a free port of 127.0.0.1, under the name
    "served" with this module's key and `settings` as its flags (exit_layer=6 -> --exit-layer 6);
    yields (its /v1 URL, its pid) once it answers, and stops it with SIGTERM at the end. Its output
    goes to `log`.

    Why a process: two threads of one process that both decode each run an OpenMP team, and libgomp
    then has more threads than CPUs and lets every team's workers sleep between parallel regions (its
    throttled spin); decoding in this process beside a server thread ran several times slower, both
    of them. A process per server is also what its users run."""
    port = _free_port()
    command = [sys.executable, "-m", "selfspec", "serve", model, "--port", str(port), "--api-key", KEY,
               "--served-model-name", "served", "--max-batch", str(max_batch), "--device", device,
               "--dtype", dtype]
    for name, value in settings.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):  # --overlap / --no-overlap
            command.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            command += [flag, str(value)]
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


def _stream(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: its text, tokens, time to the first chunk and chunk times."""
    body = {"model": "served", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
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
           reference: list[str]) -> dict:
    """`requests` requests from `concurrency` clients; the level's figures."""
    order = [i % len(prompts) for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: _stream(url, prompts[i], max_tokens), order))
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


def _complete(url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy completion in one response (no stream): its text, or the error."""
    response = _client().post(f"{url}/completions", json={"model": "served", "prompt": prompt,
                                                           "max_tokens": max_tokens, "temperature": 0})
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
    """Process `pid`'s resident memory (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def fault_run(url: str, prompts: list[str], reference: list[str], total: int, max_tokens: int,
              pid: int = 0, seed: int = 0) -> dict:
    """`total` requests, a third bad (each kind in turn), the rest good; which got what, and the
    resident memory of the server's process `pid` before and after. A good one counts as answered when
    its text is `reference`'s for its prompt (decoded alone)."""
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
    return {"requests": total, "bad": len(bad), "bad_refused_4xx": sum(400 <= c < 500 for _, c in bad),
            "bad_codes": sorted({f"{k}: {c}" for k, c in bad}), "good": len(good),
            "good_ok": sum(good),
            "resident_before": before, "resident_after": _resident_bytes(pid)}


def to_markdown(report: dict) -> str:
    lines = [f"# Server under load: {report['model']}", "",
             f"{report['requests']} greedy streamed requests per level, up to {report['max_tokens']} tokens "
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
                      f"{fault['resident_before'] / 2**20:.0f} -> {fault['resident_after'] / 2**20:.0f} MiB."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

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


def serve_load(model: str, *, prompts: str | None = None, corpus: str = "stdlib", num_prompts: int = 8,
               concurrency: str = "1,2,4,8", requests: int = 16, max_tokens: int = 64, max_batch: int = 8,
               fault: int = 0, device: str | None = None, dtype: str = "auto", out: str = "runs/serve-load",
               prefix_cache_mb: int = 256, **overrides) -> ServeLoadReport:
    """Run the load benchmark on `model` (see the module docstring); returns the report. Both servers
    and the in-process generators prefill through prefix caches of `prefix_cache_mb` MiB (0: none)."""
    from ..checkpoint import load_tuned

    levels = [int(c) for c in concurrency.split(",")]
    prefix_cache_of(prefix_cache_mb)  # a bad size fails before anything loads
    if requests < 1 or max_tokens < 1 or not levels or min(levels) < 1:
        raise UserError(f"--requests ({requests}), --max-tokens ({max_tokens}) and every --concurrency "
                        f"({concurrency}) must be >= 1")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    gen = load_tuned(model, device=device or "auto", dtype=dtype, **overrides)
    plain = SelfSpecGenerator(gen.model, gen.tokenizer, settings=PLAIN)
    for generator in (gen, plain):  # each its own, as each server has
        generator.prefix_cache = prefix_cache_of(prefix_cache_mb)
    texts = [gen.tokenizer.decode(ids) for ids in read_prompts(gen.tokenizer, prompts, corpus, num_prompts)]
    ids = [list(gen.tokenizer(t)["input_ids"]) for t in texts]

    def in_process(generator) -> tuple[float, list[str]]:
        start, tokens, replies = time.perf_counter(), 0, []
        for prompt in ids:
            out = generator.generate([prompt], max_new_tokens=max_tokens)
            tokens += len(out.sequences[0])
            replies.append(gen.tokenizer.decode(out.sequences[0], skip_special_tokens=True))
        return tokens / (time.perf_counter() - start), replies

    in_process(gen)  # warm-up: kernels, caches
    rate, reference = in_process(gen)
    plain_rate, plain_reference = in_process(plain)
    if plain_reference != reference:
        raise UserError("plain and self-speculative decoding disagree in process; run the tests")
    def alone(generator):  # prompt i decoded in process by `generator`
        return lambda i: generator.generate([ids[i]], max_new_tokens=max_tokens)

    speedup = _paired_speedup(alone(gen), alone(plain), len(ids))
    common = dict(max_batch=max_batch, device=device or "auto", dtype=dtype, prefix_cache_mb=prefix_cache_mb)
    logs = Path(out)
    plain_flags = {**overrides, **PLAIN_FLAGS}
    with (server_process(model, logs / "server.log", **common, **overrides) as (url, pid),
          server_process(model, logs / "server-plain.log", **common, **plain_flags) as (plain_url, _)):
        urls = {"selfspec": url, "plain": plain_url}
        # Warm-up: every prompt once to each server, as the in-process generators had every prompt
        # (their rate above): a prefix cache that holds a prompt prefills it in a fraction of the
        # time, so a server that had one prompt would pay a prefill the in-process call does not.
        for arm in ARMS:
            _level(urls[arm], texts, 1, len(texts), max_tokens, reference)
        def served(way, at):  # prompt i requested from the server at `at` by one client
            return lambda i: way(at, texts[i], max_tokens)

        # the server's own cost at one client (streamed, and in one response), and its speedup
        streamed = _paired_speedup(served(_stream, url), alone(gen), len(texts))
        whole = _paired_speedup(served(_complete, url), alone(gen), len(texts))
        served_speedup = _paired_speedup(served(_stream, url), served(_stream, plain_url), len(texts))
        results = {arm: [] for arm in ARMS}
        for level in levels:  # the arms interleaved level by level
            for arm in ARMS:
                results[arm].append(_level(urls[arm], texts, level, requests, max_tokens, reference))
        fault_report = fault_run(url, texts, reference, fault, max_tokens, pid) if fault else None
    report = {"model": model, "settings": gen.settings.describe(), "requests": requests,
              "max_tokens": max_tokens, "num_prompts": len(texts), "max_batch": max_batch,
              "in_process_tokens_per_second": rate, "in_process_plain_tokens_per_second": plain_rate,
              "in_process_speedup": speedup, "served_speedup": served_speedup,
              "served_vs_in_process": streamed, "whole_vs_in_process": whole,
              "levels": results, "fault": fault_report}
    publish(out, "serve_load", report, to_markdown(report), plot)
    return report
