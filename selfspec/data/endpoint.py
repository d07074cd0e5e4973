"""An OpenAI-compatible server (vLLM, SGLang, llama.cpp's llama-server, `selfspec serve`) as a source of
replies: its options, the requests, and every way a request fails as one line.

    async with Endpoint(EndpointOptions(endpoint="http://127.0.0.1:8000/v1")) as server:
        reply = await server.complete(request_body(...), "prompt p3")

`Endpoint` is an httpx client of one server: a request that meets a 408, 429 or 5xx, a timeout or a
dropped connection is sent again after a wait (the server's Retry-After, else `backoff` seconds doubled
each time), at most `retries` times; any other failure (a refused key, a missing route, a 4xx, a body
that is not JSON or not a completion) is an `EndpointError` of one line at once. The token ids of a
reply are read where the server returns them (vLLM's `token_ids`, llama.cpp's logprob ids, vLLM's
`token_id:N` logprob tokens); elsewhere they are None and the caller tokenizes the text.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import UserError
from ..flags import Options, option

RETRIED = (408, 429, 500, 502, 503, 504)  # statuses a request is sent again after
CONNECT_TIMEOUT = 10.0  # seconds to open a connection: an address that answers nothing fails fast
MAX_WAIT = 30.0  # the longest wait between two tries
# What asks a server for the reply's token ids: vLLM's two spellings, and logprobs, whose entries carry
# the ids on llama.cpp's server (one alternative per token, the cheapest that returns any).
ASK_IDS_VLLM = {"return_token_ids": True, "return_tokens_as_token_ids": True}
ASK_IDS_CHAT = {"logprobs": True, "top_logprobs": 1, **ASK_IDS_VLLM}
ASK_IDS_TEXT = {"logprobs": 1, **ASK_IDS_VLLM}


class EndpointError(UserError):
    """A server that cannot give the replies: unreachable, refusing, or answering something else;
    `status`: the HTTP status of the answer that refused (None: no such answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class PromptRefused(EndpointError):
    """The server refused one prompt, not the run: a 4xx for it (too long for its context, a schema its
    grammar engine rejects) other than a refused key, route or rate, or a reply without text (a reasoning
    parser's `content: null`). `reason` says which, as the server put it."""

    def __init__(self, message: str, reason: str, status: int | None = None):
        super().__init__(message, status)
        self.reason = reason


RUN_REFUSALS = (401, 403, 404)  # the key or the route: every prompt would be refused alike


@dataclass(frozen=True, kw_only=True)
class EndpointOptions(Options):
    """Where the replies are generated when not in this process: an OpenAI-compatible server."""

    endpoint: str | None = None
    """an OpenAI-compatible server's URL (http://HOST:PORT/v1 of vLLM, SGLang, llama-server or selfspec
    serve) to generate the replies there; it must serve MODEL (checked)"""
    api_key: str | None = None
    """the server's API key (default: $OPENAI_API_KEY)"""
    concurrency: int = 16
    """requests in flight at once (default: 16)"""
    request_timeout: float = 600.0
    """seconds one request may take before it is sent again (default: 600)"""
    retries: int = 5
    """times a request is sent again after a 429, a 5xx, a timeout or a dropped connection (default: 5)"""
    server_model: str | None = None
    """the model's name on the server (default: the one its /v1/models lists)"""
    probe: bool = True
    """check that the server serves MODEL by answering two prompts here too (loads MODEL in this process);
    --no-probe: only MODEL's tokenizer and chat template are loaded, and the server is trusted"""
    retry_refused: bool = False
    """ask again for the prompts the server refused in an earlier run (errors.jsonl); by default a
    continued run skips them"""
    min_probe_match: float = 0.8
    """refuse a server whose greedy replies to two probe prompts agree with MODEL's on a smaller share of
    tokens (default: 0.8; a near match above it, e.g. a quantized copy, is a warning)"""
    backoff: float = option(1.0, cli=False)
    """seconds before the first retry, doubled for each next one"""

    def check(self):
        if self.endpoint is not None:
            base_url(self.endpoint)
        for flag, value, least in (("--concurrency", self.concurrency, 1), ("--retries", self.retries, 0)):
            if type(value) is not int or value < least:
                raise UserError(f"{flag} must be an integer of {least} or more, got {value!r}")
        if not 0 < self.request_timeout < float("inf"):
            raise UserError(f"--request-timeout must be seconds over 0, got {self.request_timeout}")
        if not 0 <= self.min_probe_match <= 1:
            raise UserError(f"--min-probe-match must be a share in [0, 1], got {self.min_probe_match}")
        if not 0 <= self.backoff < float("inf"):
            raise UserError(f"backoff must be a number of seconds >= 0, got {self.backoff}")


def base_url(endpoint: str) -> str:
    """The server's OpenAI base URL: `endpoint` as given when it has a path (http://host:8000/v1),
    with /v1 added when it has none (http://host:8000)."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--endpoint {endpoint!r} is not an http(s) URL; pass the server's address, e.g. "
                        f"http://127.0.0.1:8000/v1")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


@dataclass(frozen=True)
class Completion:
    """One reply: its text, its token ids where the server returned them, the server's count of its
    tokens (`usage.completion_tokens`, None when absent) and why it ended."""

    text: str
    token_ids: list[int] | None
    completion_tokens: int | None
    finish_reason: str | None


def request_body(model: str, prompt: str, chat: bool, max_tokens: int, sampling: dict,
                 schema: dict | None = None, ask_ids: bool = False) -> tuple[str, dict]:
    """(path, body) of one completion: a chat completion of one user turn (`chat`), else a text completion
    of `prompt`. sampling: temperature, top_p, seed; schema: the JSON schema the reply must follow;
    ask_ids: also ask for the reply's token ids."""
    body = {"model": model, "max_tokens": max_tokens, **sampling, "stream": False}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    if ask_ids:
        body.update(ASK_IDS_CHAT if chat else ASK_IDS_TEXT)
    return ("/chat/completions" if chat else "/completions"), body


def parse_completion(payload, chat: bool) -> Completion:
    """The first choice of a completion's JSON body; ValueError when it has none."""
    choice = payload["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    if not isinstance(text, str):
        raise ValueError(f"the reply has no text (content: {json.dumps(text)})")
    usage = payload.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Completion(text, _token_ids(choice), tokens if isinstance(tokens, int) else None,
                      choice.get("finish_reason"))


def _token_ids(choice: dict) -> list[int] | None:
    """The reply's token ids in a choice, where the server put them; None where it put none."""
    ids = choice.get("token_ids")  # vLLM's return_token_ids
    if isinstance(ids, list) and all(type(i) is int for i in ids):
        return ids
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    entries = logprobs.get("content")  # chat completions (llama.cpp's text completions too)
    if isinstance(entries, list) and entries and all(isinstance(e, dict) for e in entries):
        if all(type(e.get("id")) is int for e in entries):  # llama.cpp
            return [e["id"] for e in entries]
        tokens = [e.get("token") for e in entries]
    else:
        tokens = logprobs.get("tokens")  # text completions
    if isinstance(tokens, list) and tokens and all(isinstance(t, str) and t.startswith("token_id:")
                                                   and t[9:].isdigit() for t in tokens):
        return [int(t[9:]) for t in tokens]  # vLLM's return_tokens_as_token_ids
    return None


class Endpoint:
    """An async client of one OpenAI-compatible server (see the module docstring); `async with`."""

    def __init__(self, options: EndpointOptions):
        import httpx

        self.options, self.url = options, base_url(options.endpoint)
        key = options.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        connections = options.concurrency
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers,
            timeout=httpx.Timeout(options.request_timeout, connect=CONNECT_TIMEOUT),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *_) -> None:
        await self.http.aclose()

    async def models(self) -> list[dict]:
        """The entries of the server's /v1/models (each with its "id"): an address that does not answer is
        an error at once (a server still loading, a 503, is asked again)."""
        payload = await self._json("GET", "/models", None, "GET /models", reach_once=True)
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                 for m in data):
            raise EndpointError(f"the server at {self.url} answered GET /models without a list of models "
                                f"(data: [{{id}}, ...]); pass the address of an OpenAI-compatible server")
        return data

    async def complete(self, path: str, body: dict, what: str, refusable: bool = False) -> Completion:
        """One completion (`request_body`'s path and body), tried again as the module docstring says;
        `what` names it in an error ("prompt p3"). `refusable`: a refusal of this one prompt (a 4xx other
        than `RUN_REFUSALS`, a reply without text) is a `PromptRefused`."""
        payload = await self._json("POST", path, body, f"the request for {what}", refusable=refusable)
        try:
            return parse_completion(payload, "messages" in body)
        except ValueError as exc:  # a completion without text: this prompt's reply, not the server
            if not refusable:
                raise EndpointError(f"the server at {self.url} answered the request for {what} with {exc}; "
                                    f"pass the address of an OpenAI-compatible server") from None
            raise PromptRefused(f"the server answered {what} without a reply text", str(exc)) from None
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"the server at {self.url} answered the request for {what} with JSON that is "
                                f"not a completion ({_excerpt(json.dumps(payload))}); pass the address of an "
                                f"OpenAI-compatible server") from None

    async def _json(self, method: str, path: str, body: dict | None, what: str, reach_once: bool = False,
                    refusable: bool = False):
        """The JSON body of a 2xx answer to `method path`, retried on a transient failure; `reach_once`: a
        connection that fails is an error at once (a mistyped address); `refusable` as `complete`'s."""
        import httpx

        tries = 1 + self.options.retries
        for attempt in range(tries):
            wait, failure = None, None
            try:
                response = await asyncio.wait_for(self.http.request(method, path, json=body),
                                                  self.options.request_timeout)
            except (httpx.TransportError, asyncio.TimeoutError) as exc:
                failure = _transport_failure(exc, self.options.request_timeout)
                if reach_once:
                    raise EndpointError(f"cannot reach the server at {self.url} ({failure}); start it, or "
                                        f"pass its address to --endpoint") from None
            else:
                if response.status_code not in RETRIED:
                    return self._payload(response, what, refusable)
                failure, wait = f"{response.status_code}: {_message(response)}", _retry_after(response)
            if attempt + 1 < tries:
                await asyncio.sleep(min(MAX_WAIT, wait if wait is not None else
                                        self.options.backoff * 2 ** attempt * random.uniform(0.75, 1.0)))
        raise EndpointError(f"the server at {self.url} failed {what} {tries} times (last: {failure})")

    def _payload(self, response, what: str, refusable: bool = False):
        """The JSON of a final answer, or the one line that says why there is none."""
        status = response.status_code
        if refusable and 400 <= status < 500 and status not in RUN_REFUSALS:
            raise PromptRefused(f"the server at {self.url} refused {what} ({status}: {_message(response)})",
                                _message(response), status)
        if not 200 <= status < 300:
            why, fix = f"({status}: {_message(response)})", ""
            if status in (401, 403):
                what, fix = "the API key", "; pass its key with --api-key (or $OPENAI_API_KEY)"
            elif status == 404:
                what, fix = response.request.url.path, "; pass its OpenAI base URL, which ends in /v1"
            raise EndpointError(f"the server at {self.url} refused {what} {why}{fix}", status)
        try:
            return response.json()
        except ValueError:
            kind = response.headers.get("content-type", "no content type")
            raise EndpointError(f"the server at {self.url} answered {what} with a body that is not JSON "
                                f"({kind}: {_excerpt(response.text)}); pass the address of an "
                                f"OpenAI-compatible server") from None


def _transport_failure(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, asyncio.TimeoutError) or "Timeout" in type(exc).__name__:
        return f"no answer within {timeout:g} s"
    return " ".join(str(exc).split()) or type(exc).__name__


def _message(response) -> str:
    """An error answer's message: OpenAI's error.message, FastAPI's detail, else the text's start."""
    try:
        payload = response.json()
    except ValueError:
        return _excerpt(response.text or response.reason_phrase)
    if isinstance(payload, dict):
        error = payload.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message if isinstance(message, str) else payload.get("detail") or payload.get("message")
        if isinstance(message, str):
            return _excerpt(message)
    return _excerpt(json.dumps(payload))


def _retry_after(response) -> float | None:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _excerpt(text: str, chars: int = 120) -> str:
    """`text` on one line, cut at `chars` characters."""
    line = " ".join(str(text).split())
    return repr(line if len(line) <= chars else line[:chars] + "...")
