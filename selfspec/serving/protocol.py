"""The OpenAI request bodies selfspec serves, and its errors in OpenAI's shape.

Fields a client may send but selfspec does not use (`user`, `metadata`, ...) are ignored; fields that
would change the output in a way selfspec does not support (`n` > 1, penalties, logprobs, tools) are
refused with a 400 that names the field, never silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error response: HTTP `status`, and OpenAI's body {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = "response"
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as the chat template reads it: text parts joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Request(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # beyond OpenAI's fields, as vLLM takes it
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def refuse_unsupported(self) -> None:
        """A 400 for each field whose value selfspec cannot honour."""
        if self.n != 1:
            raise APIError(400, "n > 1 is not supported; send one request per completion", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it would change the model's distribution)",
                               name)
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if len(self.stops()) > 4 or any(not s for s in self.stops()):
            raise APIError(400, "stop takes up to 4 non-empty strings", "stop")


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools:
            raise APIError(400, "tools are not supported; use response_format with a json_schema", "tools")

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


class CompletionRequest(_Request):
    model_config = ConfigDict(extra="ignore")
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for text completions
    echo: bool = False

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise APIError(400, "send one prompt per request", "prompt")

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse(schema: type[BaseModel], body: bytes):
    """The request body as `schema`, or a 400 that names the first bad field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "json_invalid":
            raise APIError(400, "the body is not valid JSON", None) from None
        raise APIError(400, f"{where}: {first['msg']}", where) from None
