"""The FastAPI application: OpenAI's chat and text completions over one `Scheduler`.

    app = create_app(load_tuned("runs/demo/model"), "demo")      # uvicorn.run(app) serves it

Every /v1 endpoint checks the Bearer key when one is set (in constant time), reads the body itself
(so a body over the limit or a bad field is one OpenAI-shaped 400 naming the field, not FastAPI's
422), and answers 429 with Retry-After when the queue is full. /health and /metrics need no key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..decoding.prefix import prefix_cache_of
from ..errors import UserError
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, parse
from .scheduler import Job, QueueFull, Scheduler, default_draft_max_rows

RETRY_AFTER_SECONDS = 1
GRACE_SECONDS = 30  # what a request in flight gets to finish when the server is told to stop


def create_app(generator, model_name: str, *, api_key: str | None = None, max_batch: int = 8,
               max_queue: int = 64, rounds_per_call: int | None = None,
               draft_max_rows: int | str | None = "auto", max_tokens_cap: int = 2048,
               max_body_bytes: int = 1 << 20, default_max_tokens: int = 256, grace: float = 30.0) -> FastAPI:
    """The server of `generator` (a `SelfSpecGenerator` with a tokenizer) under the name `model_name`.

    rounds_per_call, draft_max_rows: see `Scheduler` ("auto": `default_draft_max_rows`). max_tokens_cap:
    the most tokens one request may ask for; default_max_tokens: a chat request's when it names none.
    The scheduler's thread runs while the application's lifespan does; at shutdown the requests in
    flight get `grace` seconds to finish, then end (`Scheduler.stop`)."""
    metrics = Metrics(generator)
    if draft_max_rows == "auto":
        draft_max_rows = default_draft_max_rows(generator)
    scheduler = Scheduler(generator, max_batch=max_batch, max_queue=max_queue,
                          rounds_per_call=rounds_per_call, draft_max_rows=draft_max_rows,
                          on_wave=metrics.wave_done)
    positions = generator.view.max_positions
    drafter = generator.settings.drafter

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.stop(grace)

    app = FastAPI(title="selfspec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                           kind="authentication_error", code="invalid_api_key")

    async def body_of(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(400, f"the body is over the server's limit of {max_body_bytes} bytes", "body")
        body = await request.body()
        if len(body) > max_body_bytes:
            raise APIError(400, f"the body is over the server's limit of {max_body_bytes} bytes", "body")
        return body

    def job_of(req, prompt: list[int], max_tokens: int, schema: dict | None, prompt_field: str) -> Job:
        """The checks every request passes before it may wait for a wave."""
        req.refuse_unsupported()
        if req.model != model_name:
            raise APIError(400, f"unknown model {req.model!r}; this server serves {model_name!r}", "model",
                           code="model_not_found")
        if max_tokens > max_tokens_cap:
            raise APIError(400, f"max_tokens = {max_tokens} is over the server's cap of {max_tokens_cap}",
                           "max_tokens")
        if positions is not None and len(prompt) + max_tokens > positions:
            raise APIError(400, f"the prompt's {len(prompt)} tokens plus max_tokens = {max_tokens} exceed "
                                f"the model's {positions} positions", prompt_field)
        if schema is not None:
            from ..decoding.grammar import Constraint

            try:
                generator.grammar_tokenizer().matcher(Constraint.of(json_schema=schema))
            except UserError as exc:
                raise APIError(400, str(exc), "response_format") from None
        return Job(prompt=prompt, max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                   top_p=req.top_p, seed=req.seed, stops=req.stops(), schema=schema,
                   loop=asyncio.get_running_loop(), events=asyncio.Queue())

    def submit(job: Job) -> None:
        try:
            scheduler.submit(job)
        except QueueFull:
            raise APIError(429, "the server is busy; retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        metrics.queue.set(scheduler.waiting)

    def usage(job: Job) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens)}

    async def respond(request: Request, req, job: Job, kind: str):
        """The whole response, or its stream of server-sent events."""
        endpoint = request.url.path
        ident, created = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "created": created, "model": model_name}

        def choice(text: str | None, reason: str | None, delta: bool = False) -> dict:
            if kind == "chat":
                content = {"role": "assistant", "content": text} if not delta else (
                    {"content": text} if text is not None else {})
                return {"index": 0, ("delta" if delta else "message"): content, "finish_reason": reason}
            return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}

        async def next_event(queued=None):
            """The job's next event (`queued`, one already taken, first); an error event raises."""
            event = queued if queued is not None else await job.events.get()
            if event[0] == "error":
                raise APIError(500, event[1], kind="server_error")
            return event

        if not req.stream:
            try:
                while (await next_event())[0] != "done":
                    pass
            except asyncio.CancelledError:
                job.cancelled = True
                raise
            metrics.requests.labels(endpoint, "200").inc()
            # a response, not a dict: FastAPI would walk a dict through jsonable_encoder first, a
            # tenth of the event loop's time per request in a profile (py-spy, session 33)
            return JSONResponse({**head, "object": "chat.completion" if kind == "chat" else "text_completion",
                                 "choices": [choice(job.text, job.finish_reason)], "usage": usage(job),
                                 "selfspec": job.stats(drafter)})

        chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def sse(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            try:
                if kind == "chat":
                    yield sse({**head, "object": chunk_object,
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})
                queued = None  # an event taken while merging text, not yet sent
                while True:
                    try:
                        event, queued = await next_event(queued), None
                    except APIError as exc:
                        yield sse(exc.body())
                        return
                    if event[0] == "text":
                        text, queued = merged_text(event[1], job.events)
                        yield sse({**head, "object": chunk_object, "choices": [choice(text, None, True)]})
                        continue
                    # the last events in one write: each write wakes the client, which shares the CPUs
                    yield "".join([sse({**head, "object": chunk_object, "selfspec": job.stats(drafter),
                                        "choices": [choice(None, job.finish_reason, True)]}),
                                   sse({**head, "object": chunk_object, "choices": [], "usage": usage(job)})
                                   if include_usage else "", "data: [DONE]\n\n"])
                    return
            finally:  # the client went away (the task is cancelled) or the stream ended
                if job.finish_reason is None:
                    job.cancelled = True

        metrics.requests.labels(endpoint, "200").inc()
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse(ChatRequest, await body_of(request))
        if getattr(generator.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        prompt = generator.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages])
        max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
        job = job_of(req, prompt, max_tokens, req.schema(), "messages")
        submit(job)
        return await respond(request, req, job, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse(CompletionRequest, await body_of(request))
        prompt = list(generator.tokenizer(req.text())["input_ids"])
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        job = job_of(req, prompt, req.max_tokens, None, "prompt")
        submit(job)
        return await respond(request, req, job, "text")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "selfspec"}]}

    @app.get("/health")
    async def health():
        alive = scheduler.thread is not None and scheduler.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "starting", "waiting": scheduler.waiting},
                            status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        metrics.queue.set(scheduler.waiting)
        return PlainTextResponse(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app


def merged_text(text: str, events: asyncio.Queue) -> tuple[str, tuple | None]:
    """`text` and the text events already queued behind it, joined: a client that fell behind gets them
    as one chunk. Returns (the text, the first other event taken from the queue, or None)."""
    while not events.empty():
        event = events.get_nowait()
        if event[0] != "text":
            return text, event
        text += event[1]
    return text, None


def run_in_thread(app: FastAPI, port: int, host: str = "127.0.0.1"):
    """Serve `app` with uvicorn on a daemon thread (benchmarks, tests); returns the uvicorn server,
    started. `server.should_exit = True` stops it."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    threading.Thread(target=server.run, name="selfspec-serve", daemon=True).start()
    for _ in range(1200):
        if server.started:
            return server
        time.sleep(0.05)
    raise RuntimeError(f"the server on {host}:{port} did not start")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_batch: int = 8, max_queue: int = 64,
          rounds_per_call: int | None = None, draft_max_rows: int | None = None, max_tokens_cap: int = 2048,
          prefix_cache_mb: int = 256, device: str = "auto", dtype: str = "auto", **overrides) -> None:
    """`selfspec serve MODEL`: load the checkpoint at its stored settings (flags override them) and
    serve it until interrupted. The key comes from --api-key or $SELFSPEC_API_KEY. Prompts prefill
    through a prefix cache of `prefix_cache_mb` MiB (0: none), so requests that share a system turn
    or an instruction compute it once."""
    import logging
    import os
    import signal

    import uvicorn

    from ..checkpoint import load_tuned

    api_key = api_key or os.environ.get("SELFSPEC_API_KEY") or None
    if rounds_per_call is not None and rounds_per_call < 1:
        raise UserError(f"--rounds-per-call must be 1 or more, got {rounds_per_call}")
    if draft_max_rows is not None and draft_max_rows < 0:
        raise UserError(f"--draft-max-rows must be 0 or more, got {draft_max_rows}")
    prefix_cache = prefix_cache_of(prefix_cache_mb)  # a bad size fails before the model loads
    generator = load_tuned(model, device=device, dtype=dtype,
                           **{k: v for k, v in overrides.items() if v is not None})
    generator.prefix_cache = prefix_cache
    if generator.tokenizer is None:
        raise UserError(f"{model} has no tokenizer; the server needs one to read and write text")
    name = served_model_name or model.rstrip("/")
    app = create_app(generator, name, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
                     rounds_per_call=rounds_per_call, draft_max_rows="auto" if draft_max_rows is None
                     else draft_max_rows, max_tokens_cap=max_tokens_cap, grace=GRACE_SECONDS)
    logging.basicConfig(level=logging.INFO)  # a failed wave's traceback goes to the log
    where = "" if host in ("127.0.0.1", "localhost", "::1") else " (reachable from other machines)"
    rows = app.state.scheduler.draft_max_rows
    plainly = "" if rows is None else f" (greedy batches of more than {rows} decode plainly)"
    print(f"selfspec serve: {name} on http://{host}:{port}/v1{where}, drafter "
          f"{generator.settings.describe()}{plainly}, {'a key required' if api_key else 'no key'}")
    # SIGTERM: uvicorn stops accepting and waits for open requests, then the lifespan stops the
    # scheduler, which ends what is still decoding. Uvicorn then raises the signal again for the
    # handler it found; a no-op one lets the command return, so a stop on request exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_SECONDS)
