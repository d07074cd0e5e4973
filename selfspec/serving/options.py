"""The server's options, each flag declared once (`selfspec.flags`): `AppOptions`, what `create_app`
takes (its limits and its key), and `ServeOptions`, the `selfspec serve` command's (the application's
options, the checkpoint, where to listen, the decode settings it overrides). Importing this module
needs none of the server's extra (FastAPI, uvicorn), so the CLI reads the flags without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..decoding.prefix import prefix_cache_of
from ..errors import UserError
from ..flags import CopyOverride, DecodeOverrides, DrafterOverride, Options, StaticPassesOption, option

REQUEST_TIMEOUT = 30.0  # seconds a request's body may take to arrive, and its preparation on the pool
KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
MAX_CONNECTIONS = 256  # requests served at once (beyond: a 503 in OpenAI's shape)
GRACE_SECONDS = 30.0  # what a request in flight gets to finish when the server is told to stop


@dataclass(frozen=True, kw_only=True)
class ServerLimits(Options):
    """How much the server takes at once, and how long it waits. A limit out of its range is a
    UserError of one line that names its flag."""

    max_batch: int = 8
    """requests decoded together in one wave"""
    max_queue: int = 64
    """requests waiting at most (beyond: 429)"""
    rounds_per_call: int | None = None
    """rounds a lone request decodes between two looks at the queue (1: every round; default: about 40 ms
    of them)"""
    draft_max_rows: int | Literal["auto"] | None = "auto"
    """greedy rounds of more requests than this decode plainly: on a CPU a batch's pass costs about in
    proportion to its positions (0: never draft; default: 2 on a CPU, no limit on a GPU)"""
    max_tokens_cap: int = 2048
    """the most tokens one request may ask for"""
    max_model_len: int | None = None
    """the most tokens a request's prompt and max_tokens may take together (beyond: 400; default: the
    model's positions)"""
    max_body_bytes: int = 1 << 20
    """the largest request body, read as it arrives (beyond: 413; default: 1 MiB)"""
    request_timeout: float = REQUEST_TIMEOUT
    """seconds a request's body may take to arrive (beyond: 408), and its template, tokens and grammar on
    the worker pool (beyond: 503) (default: 30)"""
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT
    """seconds an idle keep-alive connection stays open (default: 5)"""
    max_connections: int = MAX_CONNECTIONS
    """requests served at once; beyond, a 503 (/health is always answered; uvicorn takes twice as many
    connections, idle keep-alive ones included) (default: 256)"""
    default_max_tokens: int = option(256, cli=False)
    """a chat request's max_tokens when it names none (less where the context has less room)"""

    def check(self):
        for flag, value in (("--request-timeout", self.request_timeout),
                            ("--keep-alive-timeout", self.keep_alive_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise UserError(f"{flag} must be a number of seconds over 0, got {value}")
        for flag, value, least in (("--max-batch", self.max_batch, 1), ("--max-queue", self.max_queue, 1),
                                   ("--max-tokens-cap", self.max_tokens_cap, 1),
                                   ("--max-body-bytes", self.max_body_bytes, 1),
                                   ("default_max_tokens", self.default_max_tokens, 1),
                                   ("--max-model-len", self.max_model_len, 2),
                                   ("--rounds-per-call", self.rounds_per_call, 1),
                                   ("--draft-max-rows", self.draft_max_rows, 0),
                                   ("--max-connections", self.max_connections, 1)):
            if value is None or value == "auto":
                continue
            if type(value) is not int or value < least:
                raise UserError(f"{flag} must be {least} or more, got {value}")


@dataclass(frozen=True, kw_only=True)
class AppOptions(ServerLimits):
    """What `create_app` takes: the limits, the key and who may read /metrics."""

    api_key: str | None = None
    """require Authorization: Bearer KEY (or $SELFSPEC_API_KEY)"""
    metrics_public: bool = False
    """serve /metrics without the API key (by default it needs the key when one is set)"""
    grace: float = option(GRACE_SECONDS, cli=False)
    """seconds the requests in flight get to finish when the server stops"""


@dataclass(frozen=True, kw_only=True)
class ServeOptions(AppOptions, DecodeOverrides, DrafterOverride, CopyOverride, StaticPassesOption):
    """`selfspec serve` (`app.serve`)."""

    model: str = option(positional=True)
    """a checkpoint, or any Hugging Face causal LM directory or hub id"""
    host: str = "127.0.0.1"
    """the address to bind (default: this machine only)"""
    port: int = 8000
    """the port to listen on"""
    served_model_name: str | None = None
    """the model's name in requests (default: MODEL)"""
    prefix_cache_mb: int = 256
    """keys and values of prompt prefixes kept for later requests that share them (0: none; with one, a
    long prompt that shares nothing prefills up to ~1.25x slower)"""
    device: str = "auto"
    """cuda, cpu, ... (auto: CUDA when there is one)"""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16"""

    def check(self):
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port must be 0 to 65535, got {self.port}")
        prefix_cache_of(self.prefix_cache_mb)  # a bad size fails before the model loads


__all__ = ["AppOptions", "GRACE_SECONDS", "KEEP_ALIVE_TIMEOUT", "MAX_CONNECTIONS", "REQUEST_TIMEOUT",
           "ServeOptions", "ServerLimits"]
