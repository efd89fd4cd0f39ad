"""OpenAI request bodies: parsed, checked and refused with OpenAI-style errors.

Scalar fields are checked by pydantic models (strict types, finite numbers,
unknown fields refused, a field sent as null takes its default); the fields that take several shapes (`prompt`,
message `content`, `stop`) and the refusals (`n` > 1, `logprobs`, penalties)
are checked here by hand, so every message names the field in plain words.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


__all__ = ["ApiError", "parse_json", "CompletionBody", "ChatBody", "validated", "prompts_of", "messages_of",
           "stops_of", "MAX_DEPTH", "NO_TOOLS"]

MAX_DEPTH = 32  # deepest JSON nesting accepted (a chat body needs 5)
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          431: "invalid_request_error", 503: "server_error"}


# The engine's reasons for ending a request, as the OpenAI API names them.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "abort": "abort"}


class ApiError(Exception):
    """A refused request: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object: UTF-8, finite numbers, real Unicode, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    _check_tree(body)
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _check_tree(value: Any) -> None:
    """Refuse nesting past MAX_DEPTH and strings with lone surrogates (not encodable text)."""
    todo = [(value, 1, "body")]
    while todo:
        v, depth, where = todo.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            todo += [(k, depth, where) for k in v] + [(x, depth + 1, f"{where}.{k}") for k, x in v.items()]
        elif isinstance(v, list):
            todo += [(x, depth + 1, f"{where}[{i}]") for i, x in enumerate(v)]
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"{where} holds a lone surrogate ({v[e.start]!r}): not valid Unicode") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """A field sent as JSON null takes its default, as in the OpenAI API."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 and -1: off (vLLM)
    seed: int | None = Field(None, ge=0, lt=2 ** 31)
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None


class CompletionBody(_Common):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None


def validated(model: type[_Common], body: dict) -> _Common:
    """The body as `model`, or a 400 naming the first bad field; then the refusals."""
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field {loc!r}", param=loc) from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing field {loc!r}", param=loc) from None
        got = repr(err.get("input"))
        got = f" (got {got})" if len(got) <= 40 else ""
        raise ApiError(400, f"{loc}: {err['msg']}{got}", param=loc) from None
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: _Common) -> None:
    refusals = [
        ("n", req.n != 1, "n must be 1: this server returns one choice per prompt"),
        ("logprobs", req.logprobs not in (None, False), "logprobs are not supported by this server"),
        ("top_logprobs", getattr(req, "top_logprobs", None) not in (None, 0), "top_logprobs are not supported"),
        ("frequency_penalty", req.frequency_penalty != 0, "frequency_penalty is not supported (only 0)"),
        ("presence_penalty", req.presence_penalty != 0, "presence_penalty is not supported (only 0)"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("echo", getattr(req, "echo", False), "echo is not supported"),
        ("suffix", getattr(req, "suffix", None) is not None, "suffix is not supported"),
        ("best_of", getattr(req, "best_of", None) not in (None, 1), "best_of must be 1"),
        ("stream_options", req.stream_options is not None and not req.stream,
         "stream_options is only allowed with stream: true"),
    ]
    for param, bad, message in refusals:
        if bad:
            raise ApiError(400, message, param=param)


def prompts_of(prompt: Any) -> list[str | list[int]]:
    """`prompt`: a string, a list of strings, a token-id list, or a list of those."""
    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or is_ids(prompt):
        prompt = [prompt]
    if (not isinstance(prompt, list) or not prompt
            or not all((isinstance(p, str) and p) or is_ids(p) for p in prompt)):
        raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a non-empty list of "
                            "either", param="prompt")
    return prompt


NO_TOOLS = "tools are not supported: this model's chat template does not render tool calls"


def messages_of(messages: list[Message], tools: bool = False) -> list[dict]:
    """Messages as {role, content} with string content (text parts joined by newlines), and
    the assistant's `tool_calls` and a tool's `tool_call_id` where the template renders `tools`."""
    out = []
    for i, m in enumerate(messages):
        for field, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if getattr(m, field) is None:
                continue
            if not tools:
                raise ApiError(400, f"messages[{i}].{field}: {NO_TOOLS}", param=f"messages.{i}.{field}")
            if m.role != role:
                raise ApiError(400, f"messages[{i}].{field}: only {role} messages carry {field}",
                               param=f"messages.{i}.{field}")
        c = m.content
        if isinstance(c, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) <= {"type", "text"} for p in c):
                raise ApiError(400, f"messages[{i}].content: only text parts {{\"type\": \"text\", \"text\": "
                                    f"...}} are supported", param=f"messages.{i}.content")
            c = "\n".join(p["text"] for p in c)
        elif c is None and m.role == "assistant":
            c = ""
        elif not isinstance(c, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages.{i}.content")
        extra = {k: v for k, v in (("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id)) if v is not None}
        out.append({"role": m.role, "content": c, **extra})
    return out


def stops_of(stop: Any, most: int = 16) -> tuple[str, ...]:
    """`stop`: null, a string, or a list of at most `most` strings (empty ones ignored)."""
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > most:
        raise ApiError(400, f"stop must be a string or a list of at most {most} strings", param="stop")
    return tuple(s for s in stop if s)
