"""The OpenAI wire format: validated request bodies in, response and stream-chunk bodies out.

Requests are checked strictly (a string is not a number) so that a wrong type is a 400 naming
the parameter, not a guess; fields this server does not know are ignored, as OpenAI's own
clients send more than any one server uses. Options it knows but cannot honour (echo, best_of,
suffix, tools) are refused by name rather than silently dropped.
Text the server reads must be valid Unicode: JSON can carry a lone UTF-16 surrogate
(`"\\ud800"`), which no tokenizer or UTF-8 encoder accepts.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from ..config import SEED_LIMIT


def _neutral(kind: Any, *allowed: Any, why: str) -> Any:
    """`kind` or None, of which only the given settings pass, and the OpenAPI document says so."""

    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise ValueError(f"not supported by this server ({why})")
        return value

    only = WithJsonSchema({"anyOf": [{"enum": list(allowed)}, {"type": "null"}]})
    return Annotated[kind | None, AfterValidator(check), only]


def unicode_text(value: Any) -> Any:
    """`value` unchanged if it is a string that UTF-8 can encode; a lone surrogate is a ValueError."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"must be valid Unicode text: a lone surrogate {value[err.start]!r} at character {err.start}"
            ) from None
    return value


Text = Annotated[str, AfterValidator(unicode_text)]
StopText = Annotated[str, Field(min_length=1), AfterValidator(unicode_text)]
"""A stop sequence: text that is not empty."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """What /v1/completions and /v1/chat/completions share."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-SEED_LIMIT // 2, lt=SEED_LIMIT)
    """Any int64 (and unsigned 64-bit): a negative seed draws as seed + 2**64."""
    stop: Annotated[list[StopText], Field(max_length=4)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=16)
    lookahead_sources: bool | None = False
    """An extension: each stream chunk also names where every new token's draft came from (`lookahead`)."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's keys are token ids written as strings."""
        for key in value or {}:
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        """OpenAI's one stop string is a list of one."""
        return [value] if isinstance(value, str) else value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _one_prompt(value: Any) -> Any:
    """A string or a list of token ids; OpenAI's list-of-one forms are unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return unicode_text(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and all(isinstance(p, str | list) for p in value):
        raise ValueError("several prompts in one request are not supported: send one prompt per request")
    raise ValueError("must be a string or a list of token ids")


_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}
"""What the document says a prompt is: text or token ids, not empty (an empty one is a 400)."""


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str | list[int], Field(union_mode="left_to_right"), WithJsonSchema(_PROMPT_SCHEMA)]
    echo: _neutral(bool, False, why="the prompt is not echoed") = None
    best_of: _neutral(int, 1, why="one candidate per request") = None
    logprobs: int | None = Field(None, ge=0, le=5)
    """Each token's log-probability and this many likeliest alternatives (OpenAI's limit is 5)."""
    suffix: _neutral(str, "", why="insertion is not supported") = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _one_prompt(value)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str = ""

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        """Plain text, or OpenAI's list of content parts when every part is text."""
        if value is None:
            return ""
        if isinstance(value, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
            ):
                raise ValueError("only text content is supported (a string, or parts of type 'text')")
            value = "".join(p["text"] for p in value)
        return unicode_text(value)

    def for_template(self) -> dict[str, str]:
        """Chat templates know 'system'; OpenAI's newer 'developer' role means the same."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: _neutral(list, [], why="tool calls are not supported") = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("only allowed when logprobs is true")
        return value

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens` is the newer name of `max_tokens`; either may be sent."""
        return self.max_completion_tokens or self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(body: dict | str) -> str:
    """One server-sent event; the stream ends with the plain `[DONE]` marker."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


@dataclass
class Reply:
    """The id, time and model every body of one response repeats, and the shape for its endpoint."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def full(self, choices: list[tuple[str, str, dict | None]], counts: dict[str, int]) -> dict:
        """The whole answer of a non-streaming request: (text, finish reason, log-probabilities) of each choice."""
        if self.chat:
            bodies = [
                {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": end}
                for i, (text, end, logprobs) in enumerate(choices)
            ]  # fmt: skip
            return {**self._envelope("chat.completion", bodies), "usage": counts}
        bodies = [
            {"index": i, "text": text, "logprobs": logprobs, "finish_reason": end}
            for i, (text, end, logprobs) in enumerate(choices)
        ]
        return {**self._envelope("text_completion", bodies), "usage": counts}

    def chunk(
        self,
        index: int = 0,
        text: str | None = None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: dict | None = None,
        sources: dict | None = None,
    ) -> dict:
        """One stream chunk of choice `index`: a text delta, or (with `finish_reason`) its closing one.

        `sources`: the `lookahead` extension (only for a request that asked for it).
        """
        if not self.chat:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            delta: dict[str, str] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if sources is not None:
            choice["lookahead"] = sources
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, counts: dict[str, int]) -> dict:
        """The extra last chunk OpenAI sends when `stream_options.include_usage` is set."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        return {**body, "usage": counts}
