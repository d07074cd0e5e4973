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
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..cpu import on_a_thread_that_ends, one_heap
from ..decoding.prefix import prefix_cache_of
from ..errors import UserError
from .options import AppOptions, ServeOptions
from .prometheus import Metrics
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
PREP_WORKERS = max(1, min(4, os.cpu_count() or 1))  # threads that template, tokenize and compile
CLIENT_GONE = 499  # the status logged and counted for a request whose client hung up (nginx's)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


# uvicorn's own limit, a backstop behind `_Guard`'s: it counts idle keep-alive connections too
UVICORN_LIMIT_FACTOR = 2


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class _Guard:
    """The outermost layer (pure ASGI, so streams pass untouched): gives each HTTP request an id
    (`request.state.request_id`, the `x-request-id` header), counts its status in the metrics (by
    endpoint; "other" for any other path), and answers an exception the application let through with a
    500 in OpenAI's shape that names the id, the traceback logged under it. An exception after the
    response started (a stream) is logged and ends the connection. More than `max_requests` requests at
    once get a 503 in OpenAI's shape (uvicorn's own limit, past it, answers in plain text); /health is
    always answered, so a supervisor still sees the server up."""

    def __init__(self, app, metrics: Metrics, max_requests: int):
        self.app, self.metrics, self.max_requests = app, metrics, max_requests
        self.in_flight = 0  # HTTP requests being served (the event loop's one thread counts them)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            self.in_flight -= 1

    async def _serve(self, scope, receive, send):
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        status = None
        app = self.app
        if self.in_flight > self.max_requests and scope.get("path") != "/health":
            busy = APIError(503, f"the server serves at most {self.max_requests} requests at once "
                                 f"(--max-connections); retry later", kind="server_error", code="overloaded",
                            headers={"retry-after": "1"})
            app = _error_response(busy)

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the client gets the id, the log gets the traceback
            logger.exception("request %s (%s %s) failed", request_id, scope.get("method"), scope.get("path"))
            if status is None:
                error = APIError(500, internal_error_message(request_id), kind="server_error")
                await _error_response(error)(scope, receive, send_with_id)
        finally:
            if status is not None:
                path = scope.get("path")
                self.metrics.requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()


def create_app(generator, model_name: str, options: AppOptions | None = None) -> FastAPI:
    """The server of `generator` (a `SelfSpecGenerator` with a tokenizer) under the name `model_name`.

    options (`AppOptions`, default its defaults): the key (`api_key`; None: none), `metrics_public`
    (/metrics without the key) and the limits: rounds_per_call, draft_max_rows (see `Scheduler`;
    "auto": `default_draft_max_rows`); max_tokens_cap: the most tokens one request may ask for;
    default_max_tokens: a chat request's when it names none (less where the context has less room);
    max_model_len: the most positions a request's prompt and max_tokens may take together (None: the
    model's); max_body_bytes: a request body's limit; request_timeout: the seconds a body may take to
    arrive (408) and a request's preparation on the worker pool (503). The scheduler's thread and the
    worker pool run while the application's lifespan does; at shutdown the requests in flight get
    `grace` seconds to finish, then end (`Scheduler.stop`).

        create_app(load_tuned("runs/demo/model"), "demo", AppOptions(api_key="KEY", max_batch=4))
    """
    handlers = _Handlers(generator, model_name, options or AppOptions())
    # no /docs, /redoc, /openapi.json: a server of two endpoints needs no pages that load scripts
    app = FastAPI(title="selfspec", lifespan=handlers.lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.scheduler, app.state.metrics = handlers.scheduler, handlers.metrics
    app.state.max_model_len = handlers.max_model_len
    app.add_middleware(_Guard, metrics=handlers.metrics, max_requests=handlers.options.max_connections)
    app.exception_handler(APIError)(handlers.api_error)
    app.exception_handler(StarletteHTTPException)(handlers.http_error)
    app.exception_handler(RequestValidationError)(handlers.validation_error)
    app.post("/v1/chat/completions")(handlers.chat_completions)
    app.post("/v1/completions")(handlers.completions)
    app.get("/v1/models")(handlers.models)
    app.get("/health")(handlers.health)
    app.get("/metrics")(handlers.prometheus)
    return app


class _Handlers:
    """The application's state (its scheduler, metrics and worker pool) and its handlers: the routes,
    the error handlers and the checks every request goes through (see the module docstring)."""

    def __init__(self, generator, model_name: str, options: AppOptions):
        self.generator, self.model_name, self.options = generator, model_name, options
        positions = generator.view.max_positions
        self.max_model_len = options.max_model_len
        if self.max_model_len is None:
            self.max_model_len = positions
        elif positions is not None and self.max_model_len > positions:
            raise UserError(f"--max-model-len {self.max_model_len} is over the model's {positions} positions")
        self.metrics = Metrics(generator)
        draft_max_rows = options.draft_max_rows
        if draft_max_rows == "auto":
            draft_max_rows = default_draft_max_rows(generator)
        self.scheduler = Scheduler(generator, max_batch=options.max_batch, max_queue=options.max_queue,
                                   rounds_per_call=options.rounds_per_call, draft_max_rows=draft_max_rows,
                                   on_wave=self.metrics.wave_done)
        self.metrics.largest_batch.set_function(lambda: self.scheduler.largest_wave)
        self.drafter = generator.settings.drafter
        self.pool: list[ThreadPoolExecutor] = []  # the worker pool, made at the lifespan's start or first use

    def worker_pool(self) -> ThreadPoolExecutor:
        if not self.pool:
            self.pool.append(ThreadPoolExecutor(PREP_WORKERS, thread_name_prefix="selfspec-prep"))
        return self.pool[0]

    @asynccontextmanager
    async def lifespan(self, _app):
        self.worker_pool()
        self.scheduler.start()
        try:
            yield
        finally:
            self.scheduler.stop(self.options.grace)
            if self.pool:
                self.pool.pop().shutdown(wait=False, cancel_futures=True)

    # -- errors in OpenAI's shape -----------------------------------------------------------------------

    async def api_error(self, request: Request, exc: APIError):
        return _error_response(exc)

    async def http_error(self, request: Request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"[:200]
        message = {404: f"no such endpoint: {where}", 405: f"method not allowed: {where}"}.get(
            exc.status_code, str(exc.detail))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(APIError(exc.status_code, message, kind=kind, headers=exc.headers))

    async def validation_error(self, request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return _error_response(APIError(400, f"{where}: {first.get('msg', 'invalid request')}", where))

    # -- the checks of a request ------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        api_key = self.options.api_key
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                           kind="authentication_error", code="invalid_api_key")

    @staticmethod
    def require_json(request: Request) -> None:
        """A 415 unless the body is declared JSON: a web page may post text/plain (or a body of no type)
        to any address without asking first (a "simple" request), never application/json."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            got = f" (got {media[:80]!r})" if media else " (none was sent)"
            raise APIError(415, "the body must be JSON sent with the header Content-Type: application/json"
                                f"{got}", code="unsupported_media_type")

    async def body_of(self, request: Request) -> bytes:
        """The body, read as it arrives and refused (413) as soon as it passes the limit, whether it
        declared its length or came in chunks."""
        limit, timeout = self.options.max_body_bytes, self.options.request_timeout
        too_large = APIError(413, f"the body is over the server's limit of {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts, size = [], 0

        async def arrive():
            nonlocal size
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)

        try:  # a deadline for the whole body: a client that trickles it in holds nothing for long
            await asyncio.wait_for(arrive(), timeout)
        except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log
            raise APIError(499, "the client closed the connection before its body arrived",
                           code="client_closed_request") from None
        except asyncio.TimeoutError:
            raise APIError(408, f"the body did not arrive within the server's {timeout:g} seconds",
                           code="request_timeout") from None
        return b"".join(parts)

    async def off_loop(self, work, *args):
        """`work(*args)` on the worker pool (in a copy of this context), within `request_timeout`: the
        event loop serves every stream and /health meanwhile. Past the limit the client gets a 503 (the
        thread finishes its work unwatched: a thread cannot be stopped)."""
        timeout = self.options.request_timeout
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.worker_pool(), contextvars.copy_context().run, work, *args)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"preparing the request took over the server's {timeout:g} seconds",
                           kind="server_error", code="request_timeout",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None

    async def read(self, request: Request, schema):
        """The request's body as `schema` once the cheap checks passed (the key, the content type, the
        size, every field's bounds, the model's name, max_tokens within the cap): no template, token or
        grammar yet."""
        self.authorize(request)
        self.require_json(request)
        req = parse(schema, await self.body_of(request))
        req.refuse_unsupported()
        if req.model != self.model_name:
            raise APIError(400, f"unknown model {req.model[:200]!r}; this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        asked, cap = req.asked_tokens(), self.options.max_tokens_cap
        if asked is not None and asked > cap:
            named = getattr(req, "max_completion_tokens", None) is not None
            field = "max_completion_tokens" if named else "max_tokens"
            raise APIError(400, f"{field} = {asked} is over the server's cap of {cap}", field)
        return req

    async def compiled_schema(self, req) -> dict | None:
        """The request's JSON schema (None: free text), compiled on the worker pool: once, as the
        tokenizer's `compiled` keeps it for the decoding thread's batches."""
        json_schema = req.schema()
        if json_schema is None:
            return None
        from ..decoding.grammar import Constraint

        def compile_schema():
            self.generator.grammar_tokenizer().compiled(Constraint.of(json_schema=json_schema))

        try:  # on a thread that ends: a deep schema's compilation recurses through megabytes of stack,
            # which a pool thread would keep resident for the server's life (an ending one's go back)
            await self.off_loop(on_a_thread_that_ends, compile_schema)
        except UserError as exc:
            raise APIError(400, " ".join(str(exc).split())[:1000], "response_format") from None
        finally:  # what the compilation freed goes back once the server is idle, refused or not
            self.scheduler.memory_freed()
        return json_schema

    def reply_tokens(self, prompt: list[int], asked: int | None, what: str, field: str) -> int:
        """The reply's token limit: `asked`, or (None) the default where the context has room for it;
        a 400 when it is over the cap or the prompt and it are over max_model_len."""
        max_model_len, default, cap = self.max_model_len, self.options.default_max_tokens, \
            self.options.max_tokens_cap
        room = None if max_model_len is None else max_model_len - len(prompt)
        tokens = asked if asked is not None else default if room is None else max(1, min(default, room))
        if tokens > cap:
            raise APIError(400, f"{field} = {tokens} is over the server's cap of {cap}", field)
        if room is not None and tokens > room:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                                f"you requested {len(prompt) + tokens} tokens ({len(prompt)} in the {what}, "
                                f"{tokens} in the completion). Please reduce the length of the {what} or "
                                "completion.", what, code="context_length_exceeded")
        return tokens

    def submit(self, request: Request, req, prompt: list[int], max_tokens: int,
               json_schema: dict | None) -> Job:
        job = Job(prompt=prompt, max_tokens=max_tokens, temperature=req.temperature,
                  top_k=req.top_k_or_off, top_p=req.top_p, seed=req.seed, stops=req.stops(),
                  schema=json_schema, request_id=request.state.request_id, loop=asyncio.get_running_loop(),
                  events=asyncio.Queue())
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise APIError(429, "the server is busy; retry shortly", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ValueError as exc:  # `Job.check`: what the checks above let through
            raise APIError(400, str(exc)) from None
        self.metrics.queue.set(self.scheduler.waiting)
        return job

    # -- the routes -------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request):
        req = await self.read(request, ChatRequest)
        if getattr(self.generator.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        prompt = await self.off_loop(chat_prompt, self.generator,
                                     [{"role": m.role, "content": m.text()} for m in req.messages])
        field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = self.reply_tokens(prompt, req.asked_tokens(), "messages", field)
        job = self.submit(request, req, prompt, max_tokens, await self.compiled_schema(req))
        return await _Reply(self, req, job, "chat").respond(request)

    async def completions(self, request: Request):
        req = await self.read(request, CompletionRequest)
        prompt = await self.off_loop(lambda: list(self.generator.tokenizer(req.text())["input_ids"]))
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        max_tokens = self.reply_tokens(prompt, req.asked_tokens(), "prompt", "max_tokens")
        job = self.submit(request, req, prompt, max_tokens, await self.compiled_schema(req))
        return await _Reply(self, req, job, "text").respond(request)

    async def models(self, request: Request):
        self.authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "selfspec"}]}

    async def health(self):
        scheduler = self.scheduler
        alive = scheduler.thread is not None and scheduler.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "starting", "waiting": scheduler.waiting},
                            status_code=200 if alive else 503)

    async def prometheus(self, request: Request):
        if not self.options.metrics_public:
            self.authorize(request)
        self.metrics.queue.set(self.scheduler.waiting)
        return PlainTextResponse(self.metrics.exposition(), media_type="text/plain; version=0.0.4")


class _Reply:
    """One job's answer: the whole response, or its stream of server-sent events."""

    def __init__(self, handlers: _Handlers, req, job: Job, kind: str):
        self.req, self.job, self.kind, self.drafter = req, job, kind, handlers.drafter
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.head = {"id": ident, "created": int(time.time()), "model": handlers.model_name}

    def choice(self, text: str | None, reason: str | None, delta: bool = False) -> dict:
        if self.kind == "chat":
            content = {"role": "assistant", "content": text} if not delta else (
                {"content": text} if text is not None else {})
            return {"index": 0, ("delta" if delta else "message"): content, "finish_reason": reason}
        return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}

    def usage(self) -> dict:
        job = self.job
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                "total_tokens": len(job.prompt) + len(job.tokens)}

    async def next_event(self, queued=None):
        """The job's next event (`queued`, one already taken, first); an error event raises."""
        event = queued if queued is not None else await self.job.events.get()
        if event[0] == "error":
            status = event[2] if len(event) > 2 else 500
            kind = "server_error" if status >= 500 else "invalid_request_error"
            raise APIError(status, event[1], kind=kind)
        return event

    async def respond(self, request: Request):
        """The whole response once the job is done (its client watched meanwhile), or the stream."""
        if self.req.stream:
            return StreamingResponse(self.events(), media_type="text/event-stream")
        job = self.job
        watcher = asyncio.ensure_future(hang_up(request, job))
        try:
            while (event := await self.next_event())[0] not in ("done", "gone"):
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
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        return JSONResponse({**self.head, "object": kind,
                             "choices": [self.choice(job.text, job.finish_reason)], "usage": self.usage(),
                             "selfspec": job.stats(self.drafter)})

    async def events(self):
        """The server-sent events: the text as it is accepted, then the finish, usage and [DONE]."""
        job, head = self.job, self.head
        chunk_object = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        try:
            if self.kind == "chat":
                yield _sse({**head, "object": chunk_object,
                            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
            queued = None  # an event taken while merging text, not yet sent
            while True:
                try:
                    event, queued = await self.next_event(queued), None
                except APIError as exc:
                    yield _sse(exc.body())
                    return
                if event[0] == "text":
                    text, queued = merged_text(event[1], job.events)
                    yield _sse({**head, "object": chunk_object, "choices": [self.choice(text, None, True)]})
                    continue
                # the last events in one write: each write wakes the client, which shares the CPUs
                yield "".join([_sse({**head, "object": chunk_object, "selfspec": job.stats(self.drafter),
                                     "choices": [self.choice(None, job.finish_reason, True)]}),
                               _sse({**head, "object": chunk_object, "choices": [], "usage": self.usage()})
                               if include_usage else "", "data: [DONE]\n\n"])
                return
        except Exception:  # noqa: BLE001 - the stream has started: its last event is the error
            logger.exception("request %s failed while streaming", job.request_id)
            yield _sse(APIError(500, internal_error_message(job.request_id), kind="server_error").body())
        finally:  # the client went away (the task is cancelled) or the stream ended
            if job.finish_reason is None:
                job.cancelled = True


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


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


def serve(options: ServeOptions) -> None:
    """`selfspec serve MODEL`: load the checkpoint at its stored settings (flags override them) and
    serve it until interrupted. The key comes from `api_key` or $SELFSPEC_API_KEY. Prompts prefill
    through a prefix cache of `prefix_cache_mb` MiB (0: none), so requests that share a system turn
    or an instruction compute it once. request_timeout: see `create_app`; keep_alive_timeout: an idle
    connection's seconds (uvicorn's `timeout_keep_alive`); max_connections: the requests served at once
    (beyond: a 503 in OpenAI's shape, `_Guard`), uvicorn taking twice as many connections (its
    `limit_concurrency`: idle keep-alive connections count there; beyond, its plain 503). A limit out
    of range is a UserError when the options are made, before the model loads.

        serve(ServeOptions(model="runs/demo/model", port=8000))
    """
    import gc
    import logging
    import os
    import signal

    import uvicorn

    from ..checkpoint import load_tuned

    one_heap()  # before the server's threads start (the CLI's call came earlier still, before its imports)
    options = replace(options, api_key=options.api_key or os.environ.get("SELFSPEC_API_KEY") or None)
    model, host, port = options.model, options.host, options.port
    prefix_cache = prefix_cache_of(options.prefix_cache_mb)
    generator = load_tuned(model, device=options.device, dtype=options.dtype, backend=options.backend,
                           static_passes=options.static_passes,
                           **{k: v for k, v in options.overrides().items() if v is not None})
    generator.prefix_cache = prefix_cache
    if generator.tokenizer is None:
        raise UserError(f"{model} has no tokenizer; the server needs one to read and write text")
    try:  # llguidance's index of the vocabulary, built now rather than by the first request with a
        # schema: that request is not slowed (0.3 s on a 49k vocabulary), and the memory it takes
        # (~30 MiB there) is the server's from the start, not growth under load
        generator.grammar_tokenizer()
    except UserError:
        pass  # no llguidance, or a tokenizer it cannot read: a request with a schema is told why
    name = options.served_model_name or model.rstrip("/")
    app = create_app(generator, name, options)
    logging.basicConfig(level=logging.INFO)  # a failed request's traceback goes to the log, under its id
    where = "" if host in ("127.0.0.1", "localhost", "::1") else " (reachable from other machines)"
    rows = app.state.scheduler.draft_max_rows
    plainly = "" if rows is None else f" (greedy batches of more than {rows} decode plainly)"
    print(f"selfspec serve: {name} on http://{host}:{port}/v1{where}, drafter "
          f"{generator.settings.describe()}{plainly}, {'a key required' if options.api_key else 'no key'}, "
          f"at most {app.state.max_model_len} positions a request")
    # SIGTERM: uvicorn stops accepting and waits for open requests, then the lifespan stops the
    # scheduler, which ends what is still decoding. Uvicorn then raises the signal again for the
    # handler it found; a no-op one lets the command return, so a stop on request exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # What is alive now (the model, the libraries) is never garbage: frozen out of the collector, the
    # idle server's collection (`SelfSpecGenerator.release_memory`) reads only what requests made, not
    # the whole heap: a full collection pauses every stream and /health.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=options.grace,
                timeout_keep_alive=options.keep_alive_timeout,
                limit_concurrency=UVICORN_LIMIT_FACTOR * options.max_connections)
