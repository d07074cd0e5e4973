"""The OpenAI request bodies selfspec serves, and its errors in OpenAI's shape.

Every number is bounded as OpenAI bounds it (the seed to int64, temperature to [0, 2], ...), so a
request that reaches a wave cannot fail it with a value. `null` in an optional field takes its default,
as OpenAI and vLLM read it. Fields a client may send but selfspec does not use (`user`, `metadata`, ...)
are ignored; fields that would change the output in a way selfspec does not support (`n` > 1,
penalties, logprobs, `logit_bias`, `min_p`, tools, vLLM's guided decoding) are refused with a 400 that
names the field, never silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INT64 = (-2**63, 2**63 - 1)  # a seed's range (OpenAI's, vLLM's): the engine keeps seeds as int64
MAX_STOPS = 4  # OpenAI's
MAX_STOP_CHARS = 256  # a stream holds back the longest stop string's length less one character


class APIError(Exception):
    """An error response: HTTP `status`, and OpenAI's body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    """A part of a request body: unknown fields ignored, no NaN or infinity, and `null` in an optional
    field read as its default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data):
        if not isinstance(data, dict):
            return data
        optional = {key for name, info in cls.model_fields.items() if not info.is_required()
                    for key in (name, info.alias) if key}
        return {key: value for key, value in data.items() if value is not None or key not in optional}


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str = "response"
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as the chat template reads it: text parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# Fields that change the output and that selfspec cannot honour: refused unless a no-op value (the
# field's default, or one that asks for nothing). name: (the no-op test, why).
_REFUSED = {
    "n": (lambda v: v == 1, "n > 1 is not supported; send one request per completion"),
    "presence_penalty": (lambda v: v == 0, "presence_penalty is not supported (it would change the "
                                           "model's distribution)"),
    "frequency_penalty": (lambda v: v == 0, "frequency_penalty is not supported (it would change the "
                                            "model's distribution)"),
    "repetition_penalty": (lambda v: v == 1, "repetition_penalty is not supported (it would change the "
                                             "model's distribution)"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported (it would change the model's distribution)"),
    "min_p": (lambda v: v == 0, "min_p is not supported; use top_p or top_k"),
    "top_logprobs": (lambda v: not v, "logprobs are not supported"),
    "min_tokens": (lambda v: v == 0, "min_tokens is not supported"),
    "ignore_eos": (lambda v: not v, "ignore_eos is not supported"),
    "use_beam_search": (lambda v: not v, "beam search is not supported"),
    "prompt_logprobs": (lambda v: v is None, "prompt_logprobs are not supported"),
    "guided_json": (lambda v: v is None, "guided_json is not supported; use response_format with a "
                                         "json_schema"),
    "guided_regex": (lambda v: v is None, "guided_regex is not supported; use response_format with a "
                                          "json_schema"),
    "guided_choice": (lambda v: v is None, "guided_choice is not supported; use response_format with a "
                                           "json_schema"),
    "guided_grammar": (lambda v: v is None, "guided_grammar is not supported; use response_format with a "
                                            "json_schema"),
    "structured_outputs": (lambda v: v is None, "structured_outputs is not supported; use response_format "
                                                "with a json_schema"),
}


class _Request(_Body):
    """What chat and text completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # beyond OpenAI's fields, as vLLM takes it (-1, 0: off)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's sampling extensions: bounded, and refused unless they ask for nothing
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator("stop")
    @classmethod
    def _stops_are_few_and_short(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stop

    @property
    def top_k_or_off(self) -> int:
        """top_k as the engine takes it (0: off; vLLM's -1 too)."""
        return max(0, self.top_k)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refuse_unsupported(self) -> None:
        """A 400 for each field whose value selfspec cannot honour."""
        for name, (no_op, why) in _REFUSED.items():
            if hasattr(self, name) and not no_op(getattr(self, name)):
                raise APIError(400, why, name)

    def schema(self) -> dict | None:
        """The JSON schema the reply must follow, or None (free text)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema", "response_format")
        return fmt.json_schema.json_schema


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise APIError(400, f"{name} are not supported; use response_format with a json_schema", name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise APIError(400, f"{name} needs tools, which are not supported", name)
        if self.audio is not None or self.modalities not in (None, ["text"]):
            raise APIError(400, "only text output is supported",
                           "modalities" if self.audio is None else "audio")

    def asked_tokens(self) -> int | None:
        """The reply's token limit the request names (max_completion_tokens, else max_tokens), or None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for text completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise APIError(400, "send one prompt per request", "prompt")

    def asked_tokens(self) -> int:
        return self.max_tokens

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse(schema: type[BaseModel], body: bytes):
    """The request body as `schema`, or a 400 that names the first bad field, in one line."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, "the body is not valid JSON", None) from None
        where = _field(first["loc"])
        message = " ".join(str(first["msg"]).removeprefix("Value error, ").split())
        if where is None:
            raise APIError(400, f"the body must be a JSON object ({message})", None) from None
        raise APIError(400, f"{where}: {message}", where) from None


def _field(loc: tuple) -> str | None:
    """A pydantic error's location as the field's path (`messages.0.content`), without the names of the
    union members pydantic tried (`prompt.str`, `stop.list[str]`)."""
    parts = [str(part) for part in loc if isinstance(part, int) or not _is_type_tag(str(part))]
    return ".".join(parts) or None


def _is_type_tag(part: str) -> bool:
    return (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part
            or part.startswith("function-"))
