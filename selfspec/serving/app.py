"""The FastAPI application: OpenAI's chat and text completions over one `Scheduler`.

    app = create_app(load_tuned("runs/demo/model"), "demo")      # uvicorn.run(app) serves it

A request is checked whole before it may join a wave: the Bearer key when one is set (in constant
time), `Content-Type: application/json` (415: a web page cannot post its text/plain forms to a server
on localhost), the body read under its limit as it arrives (413, chunked or not) and within
`request_timeout` seconds (408: a body that trickles in forever holds nothing), every field parsed
and bounded (one 400 naming the field, not FastAPI's 422), unsupported fields refused; only then the
heavy work, on a worker pool off the event loop and within `request_timeout` (503 past it): the chat
template, the tokens (of up to a MiB of text), the prompt plus max_tokens within `max_model_len`, and
the JSON schema compiled (once: the decoding thread takes the compiled grammar). A full queue
answers 429 with Retry-After. A request whose client hangs up is cancelled at the next round,
streamed or not (a non-streamed one watches for the disconnect while it waits). Every error, 404s
and 405s included, has OpenAI's body {"error": {message, type, param, code}}; an exception the
application did not expect is a 500 that names the request's id (also in the `x-request-id` header
of every response) and logs the traceback under it: its text never reaches the client. /health needs
no key; /metrics needs it unless `metrics_public`.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..decoding.prefix import prefix_cache_of
from ..errors import UserError
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, parse
from .scheduler import (
    Job,
    QueueFull,
    Scheduler,
    default_draft_max_rows,
    internal_error_message,
    new_request_id,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
GRACE_SECONDS = 30  # what a request in flight gets to finish when the server is told to stop
REQUEST_TIMEOUT = 30.0  # seconds a request's body may take to arrive, and its preparation on the pool
KEEP_ALIVE_TIMEOUT = 5  # seconds an idle keep-alive connection stays open (uvicorn's default)
MAX_CONNECTIONS = 256  # concurrent connections and requests uvicorn takes (beyond: its plain 503)
PREP_WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads that template, tokenize and compile
CLIENT_GONE = 499  # the status logged and counted for a request whose client hung up (nginx's)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def check_limits(*, max_batch: int = 8, max_queue: int = 64, max_tokens_cap: int = 2048,
                 max_body_bytes: int = 1 << 20, default_max_tokens: int = 256,
                 max_model_len: int | None = None, rounds_per_call: int | None = None,
                 draft_max_rows=None, request_timeout: float = REQUEST_TIMEOUT,
                 keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT, max_connections: int | None = None) -> None:
    """A UserError (one line, naming the flag) for a limit out of its range."""
    for flag, value in (("--request-timeout", request_timeout), ("--keep-alive-timeout", keep_alive_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise UserError(f"{flag} must be a number of seconds over 0, got {value}")
    for flag, value, least in (("--max-batch", max_batch, 1), ("--max-queue", max_queue, 1),
                               ("--max-tokens-cap", max_tokens_cap, 1),
                               ("--max-body-bytes", max_body_bytes, 1),
                               ("default_max_tokens", default_max_tokens, 1),
                               ("--max-model-len", max_model_len, 2),
                               ("--rounds-per-call", rounds_per_call, 1),
                               ("--draft-max-rows", draft_max_rows, 0),
                               ("--max-connections", max_connections, 1)):
        if value is None or value == "auto":
            continue
        if type(value) is not int or value < least:
            raise UserError(f"{flag} must be {least} or more, got {value}")


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Guard:
    """The outermost layer (pure ASGI, so streams pass untouched): gives each HTTP request an id
    (`request.state.request_id`, the `x-request-id` header), counts its status in the metrics (by
    endpoint; "other" for any other path), and answers an exception the application let through with a
    500 in OpenAI's shape that names the id, the traceback logged under it. An exception after the
    response started (a stream) is logged and ends the connection."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        status = None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the client gets the id, the log gets the traceback
            logger.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if status is None:
                error = APIError(500, internal_error_message(request_id), kind="server_error")
                await _error_response(error)(scope, receive, send_with_id)
        finally:
            if status is not None:
                path = scope.get("path")
                self.metrics.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()


def create_app(generator, model_name: str, *, api_key: str | None = None, max_batch: int = 8,
               max_queue: int = 64, rounds_per_call: int | None = None,
               draft_max_rows: int | str | None = "auto", max_tokens_cap: int = 2048,
               max_body_bytes: int = 1 << 20, default_max_tokens: int = 256, max_model_len: int | None = None,
               metrics_public: bool = False, grace: float = 30.0,
               request_timeout: float = REQUEST_TIMEOUT) -> FastAPI:
    """The server of `generator` (a `SelfSpecGenerator` with a tokenizer) under the name `model_name`.

    rounds_per_call, draft_max_rows: see `Scheduler` ("auto": `default_draft_max_rows`). max_tokens_cap:
    the most tokens one request may ask for; default_max_tokens: a chat request's when it names none
    (less where the context has less room); max_model_len: the most positions a request's prompt and
    max_tokens may take together (None: the model's); max_body_bytes: a request body's limit;
    metrics_public: /metrics without the key; request_timeout: the seconds a body may take to arrive
    (408) and a request's preparation on the worker pool (503). A limit out of range is a UserError.
    The scheduler's thread and the worker pool run while the application's lifespan does; at shutdown
    the requests in flight get `grace` seconds to finish, then end (`Scheduler.stop`)."""
    check_limits(max_batch=max_batch, max_queue=max_queue, max_tokens_cap=max_tokens_cap,
                 max_body_bytes=max_body_bytes, default_max_tokens=default_max_tokens,
                 max_model_len=max_model_len, rounds_per_call=rounds_per_call, draft_max_rows=draft_max_rows,
                 request_timeout=request_timeout)
    positions = generator.view.max_positions
    if max_model_len is None:
        max_model_len = positions
    elif positions is not None and max_model_len > positions:
        raise UserError(f"--max-model-len {max_model_len} is over the model's {positions} positions")
    metrics = Metrics(generator)
    if draft_max_rows == "auto":
        draft_max_rows = default_draft_max_rows(generator)
    scheduler = Scheduler(generator, max_batch=max_batch, max_queue=max_queue,
                          rounds_per_call=rounds_per_call, draft_max_rows=draft_max_rows,
                          on_wave=metrics.wave_done)
    drafter = generator.settings.drafter
    pool: list[ThreadPoolExecutor] = []  # the worker pool, made at the lifespan's start (or first use)

    def worker_pool() -> ThreadPoolExecutor:
        if not pool:
            pool.append(ThreadPoolExecutor(PREP_WORKERS, thread_name_prefix="selfspec-prep"))
        return pool[0]

    @asynccontextmanager
    async def lifespan(_app):
        worker_pool()
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop(grace)
            if pool:
                pool.pop().shutdown(wait=False, cancel_futures=True)

    # no /docs, /redoc, /openapi.json: a server of two endpoints needs no pages that load scripts
    app = FastAPI(title="selfspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.state.max_model_len = max_model_len
    app.add_middleware(_Guard, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"[:200]
        message = {404: f"no such endpoint: {where}", 405: f"method not allowed: {where}"}.get(
            exc.status_code, str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(APIError(exc.status_code, message, kind=kind, headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return _error_response(APIError(400, f"{where}: {first.get('msg', 'invalid request')}", where))

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                           kind="authentication_error", code="invalid_api_key")

    def require_json(request: Request) -> None:
        """A 415 unless the body is declared JSON: a web page may post text/plain (or a body of no type)
        to any address without asking first (a "simple" request), never application/json."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            got = f" (got {media[:80]!r})" if media else " (none was sent)"
            raise APIError(415, "the body must be JSON sent with the header Content-Type: application/json"
                                f"{got}", code="unsupported_media_type")

    async def body_of(request: Request) -> bytes:
        """The body, read as it arrives and refused (413) as soon as it passes the limit, whether it
        declared its length or came in chunks."""
        too_large = APIError(413, f"the body is over the server's limit of {max_body_bytes} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_large
        parts, size = [], 0

        async def arrive():
            nonlocal size
            async for part in request.stream():
                size += len(part)
                if size > max_body_bytes:
                    raise too_large
                parts.append(part)

        try:  # a deadline for the whole body: a client that trickles it in holds nothing for long
            await asyncio.wait_for(arrive(), request_timeout)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log
            raise APIError(499, "the client closed the connection before its body arrived",
                           code="client_closed_request") from None
        except asyncio.TimeoutError:
            raise APIError(408, f"the body did not arrive within the server's {request_timeout:g} seconds",
                           code="request_timeout") from None
        return b"".join(parts)

    async def off_loop(work, *args):
        """`work(*args)` on the worker pool (in a copy of this context), within `request_timeout`: the
        event loop serves every stream and /health meanwhile. Past the limit the client gets a 503 (the
        thread finishes its work unwatched: a thread cannot be stopped)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(worker_pool(), contextvars.copy_context().run, work, *args)
        try:
            return await asyncio.wait_for(future, request_timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"preparing the request took over the server's {request_timeout:g} seconds",
                           kind="server_error", code="request_timeout",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None

    async def read(request: Request, schema):
        """The request's body as `schema` once the cheap checks passed (the key, the content type, the
        size, every field's bounds, the model's name, max_tokens within the cap): no template, token or
        grammar yet."""
        authorize(request)
        require_json(request)
        req = parse(schema, await body_of(request))
        req.refuse_unsupported()
        if req.model != model_name:
            raise APIError(400, f"unknown model {req.model[:200]!r}; this server serves {model_name!r}",
                           "model", code="model_not_found")
        asked = req.asked_tokens()
        if asked is not None and asked > max_tokens_cap:
            named = getattr(req, "max_completion_tokens", None) is not None
            field = "max_completion_tokens" if named else "max_tokens"
            raise APIError(400, f"{field} = {asked} is over the server's cap of {max_tokens_cap}", field)
        return req

    async def compiled_schema(req) -> dict | None:
        """The request's JSON schema (None: free text), compiled on the worker pool: once, as the
        tokenizer's `compiled` keeps it for the decoding thread's batches."""
        json_schema = req.schema()
        if json_schema is None:
            return None
        from ..decoding.grammar import Constraint

        def compile_schema():
            generator.grammar_tokenizer().compiled(Constraint.of(json_schema=json_schema))

        try:
            await off_loop(compile_schema)
        except UserError as exc:
            raise APIError(400, " ".join(str(exc).split())[:1000], "response_format") from None
        return json_schema

    def reply_tokens(prompt: list[int], asked: int | None, what: str, field: str) -> int:
        """The reply's token limit: `asked`, or (None) the default where the context has room for it;
        a 400 when it is over the cap or the prompt and it are over max_model_len."""
        room = None if max_model_len is None else max_model_len - len(prompt)
        tokens = asked if asked is not None else default_max_tokens if room is None else max(
            1, min(default_max_tokens, room))
        if tokens > max_tokens_cap:
            raise APIError(400, f"{field} = {tokens} is over the server's cap of {max_tokens_cap}", field)
        if room is not None and tokens > room:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                                f"you requested {len(prompt) + tokens} tokens ({len(prompt)} in the {what}, "
                                f"{tokens} in the completion). Please reduce the length of the {what} or "
                                "completion.", what, code="context_length_exceeded")
        return tokens

    def submit(request: Request, req, prompt: list[int], max_tokens: int, json_schema: dict | None) -> Job:
        job = Job(prompt=prompt, max_tokens=max_tokens, temperature=req.temperature,
                  top_k=req.top_k_or_off, top_p=req.top_p, seed=req.seed, stops=req.stops(),
                  schema=json_schema, request_id=request.state.request_id, loop=asyncio.get_running_loop(),
                  events=asyncio.Queue())
        try:
            scheduler.submit(job)
        except QueueFull:
            raise APIError(429, "the server is busy; retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ValueError as exc:  # `Job.check`: what the checks above let through
            raise APIError(400, str(exc)) from None
        metrics.queue.set(scheduler.waiting)
        return job

    def usage(job: Job) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens)}

    async def respond(request: Request, req, job: Job, kind: str):
        """The whole response, or its stream of server-sent events."""
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
                status = event[2] if len(event) > 2 else 500
                kind = "server_error" if status >= 500 else "invalid_request_error"
                raise APIError(status, event[1], kind=kind)
            return event

        if not req.stream:
            watcher = asyncio.ensure_future(hang_up(request, job))
            try:
                while (event := await next_event())[0] not in ("done", "gone"):
                    pass
            except asyncio.CancelledError:
                job.cancelled = True
                raise
            finally:
                watcher.cancel()
            if event[0] == "gone":  # nobody to answer: the row ends at its next round
                logger.info("request %s: the client hung up", job.request_id)
                return Response(status_code=CLIENT_GONE)
            # a response, not a dict: FastAPI would walk a dict through jsonable_encoder first, a
            # walk of every field on the event loop for every request
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
            except Exception:  # noqa: BLE001 - the stream has started: its last event is the error
                logger.exception("request %s failed while streaming", job.request_id)
                yield sse(APIError(500, internal_error_message(job.request_id), kind="server_error").body())
            finally:  # the client went away (the task is cancelled) or the stream ended
                if job.finish_reason is None:
                    job.cancelled = True

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await read(request, ChatRequest)
        if getattr(generator.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        prompt = await off_loop(chat_prompt, generator,
                                [{"role": m.role, "content": m.text()} for m in req.messages])
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = reply_tokens(prompt, req.asked_tokens(), "messages", field)
        job = submit(request, req, prompt, max_tokens, await compiled_schema(req))
        return await respond(request, req, job, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await read(request, CompletionRequest)
        prompt = await off_loop(lambda: list(generator.tokenizer(req.text())["input_ids"]))
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        max_tokens = reply_tokens(prompt, req.asked_tokens(), "prompt", "max_tokens")
        job = submit(request, req, prompt, max_tokens, await compiled_schema(req))
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
    async def prometheus(request: Request):
        if not metrics_public:
            authorize(request)
        metrics.queue.set(scheduler.waiting)
        return PlainTextResponse(metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app


def chat_prompt(generator, messages: list[dict]) -> list[int]:
    """The conversation's prompt through the chat template; a 400 when the template refuses it (its own
    `raise_exception`, e.g. roles that do not alternate: a message written for the client)."""
    from jinja2.exceptions import TemplateError

    try:
        return generator.chat_prompt(messages)
    except TemplateError as exc:
        if type(exc) is not TemplateError:  # the template's own fault (syntax, an undefined name): a 500
            raise
        raise APIError(400, f"the chat template refused the messages: {' '.join(str(exc).split())[:500]}",
                       "messages") from None


async def hang_up(request: Request, job: Job) -> None:
    """Wait for `request`'s client to hang up (its body already read, the next ASGI message is the
    disconnect), then cancel `job` (the scheduler ends its row at the next round, or drops it from the
    queue) and wake its handler with a ("gone",) event. Cancelled when the response is ready."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True
    job.events.put_nowait(("gone", None))


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
    import contextvars
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    # in a copy of the caller's context, so that the decoding thread the app starts inherits its kernel
    # settings (`model.kernels.using`)
    threading.Thread(target=contextvars.copy_context().run, args=(server.run,), name="selfspec-serve",
                     daemon=True).start()
    for _ in range(1200):
        if server.started:
            return server
        time.sleep(0.05)
    raise RuntimeError(f"the server on {host}:{port} did not start")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_batch: int = 8, max_queue: int = 64,
          rounds_per_call: int | None = None, draft_max_rows: int | None = None, max_tokens_cap: int = 2048,
          max_model_len: int | None = None, max_body_bytes: int = 1 << 20, metrics_public: bool = False,
          request_timeout: float = REQUEST_TIMEOUT, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
          max_connections: int = MAX_CONNECTIONS, prefix_cache_mb: int = 256, device: str = "auto",
          dtype: str = "auto", **overrides) -> None:
    """`selfspec serve MODEL`: load the checkpoint at its stored settings (flags override them) and
    serve it until interrupted. The key comes from --api-key or $SELFSPEC_API_KEY. Prompts prefill
    through a prefix cache of `prefix_cache_mb` MiB (0: none), so requests that share a system turn
    or an instruction compute it once. request_timeout: see `create_app`; keep_alive_timeout: an idle
    connection's seconds (uvicorn's `timeout_keep_alive`); max_connections: the connections and
    requests uvicorn takes at once (its `limit_concurrency`; beyond: a 503). A limit out of range is a
    UserError before the model loads."""
    import logging
    import os
    import signal

    import uvicorn

    from ..checkpoint import load_tuned

    api_key = api_key or os.environ.get("SELFSPEC_API_KEY") or None
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be 0 to 65535, got {port}")
    check_limits(max_batch=max_batch, max_queue=max_queue, max_tokens_cap=max_tokens_cap,
                 max_body_bytes=max_body_bytes, max_model_len=max_model_len, rounds_per_call=rounds_per_call,
                 draft_max_rows=draft_max_rows, request_timeout=request_timeout,
                 keep_alive_timeout=keep_alive_timeout, max_connections=max_connections)
    prefix_cache = prefix_cache_of(prefix_cache_mb)  # a bad size fails before the model loads
    generator = load_tuned(model, device=device, dtype=dtype,
                           **{k: v for k, v in overrides.items() if v is not None})
    generator.prefix_cache = prefix_cache
    if generator.tokenizer is None:
        raise UserError(f"{model} has no tokenizer; the server needs one to read and write text")
    name = served_model_name or model.rstrip("/")
    app = create_app(generator, name, api_key=api_key, max_batch=max_batch, max_queue=max_queue,
                     rounds_per_call=rounds_per_call, draft_max_rows="auto" if draft_max_rows is None
                     else draft_max_rows, max_tokens_cap=max_tokens_cap, max_model_len=max_model_len,
                     max_body_bytes=max_body_bytes, metrics_public=metrics_public, grace=GRACE_SECONDS,
                     request_timeout=request_timeout)
    logging.basicConfig(level=logging.INFO)  # a failed request's traceback goes to the log, under its id
    where = "" if host in ("127.0.0.1", "localhost", "::1") else " (reachable from other machines)"
    rows = app.state.scheduler.draft_max_rows
    plainly = "" if rows is None else f" (greedy batches of more than {rows} decode plainly)"
    print(f"selfspec serve: {name} on http://{host}:{port}/v1{where}, drafter "
          f"{generator.settings.describe()}{plainly}, {'a key required' if api_key else 'no key'}, "
          f"at most {app.state.max_model_len} positions a request")
    # SIGTERM: uvicorn stops accepting and waits for open requests, then the lifespan stops the
    # scheduler, which ends what is still decoding. Uvicorn then raises the signal again for the
    # handler it found; a no-op one lets the command return, so a stop on request exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACE_SECONDS,
                timeout_keep_alive=keep_alive_timeout, limit_concurrency=max_connections)
