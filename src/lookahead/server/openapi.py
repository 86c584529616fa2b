"""What the served OpenAPI document says each route answers, so that it matches what the server sends.

FastAPI would declare a 422 for every route with input and JSON for every answer; this server
sends 400s with OpenAI's error body, plain text from /metrics and server-sent events from a
stream; and it serves one model, whose name the document gives. The models here only describe
bodies (the routes build them); the schema fuzzing test checks every answer against them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from ..decoding.transcript import FinishReason


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token of the choice (or of the chunk): its text, log-probability, alternatives and offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Alternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Alternative):
    top_logprobs: list[Alternative]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class SourcePiece(BaseModel):
    text: str
    source: str
    """Where the tokens' draft came from: model (the step's own token), prompt, answers, corpus or recycled."""


class SourcePieces(BaseModel):
    """The `lookahead_sources` extension of a stream chunk: its text by draft source, and the steps so far."""

    pieces: list[SourcePiece]
    tokens: int
    steps: int


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    lookahead: SourcePieces | None = None


class CompletionChunk(BaseModel):
    """One event of a /v1/completions stream; the last, with `stream_options.include_usage`, has only usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    lookahead: SourcePieces | None = None


class ChatChunk(BaseModel):
    """One event of a /v1/chat/completions stream; the last, with `stream_options.include_usage`, has only usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "stopping"]
    model: str
    queue_length: int
    busy: bool
    running: int
    trie_nodes: int


_ERRORS = {
    400: "A bad request; `param` names the offending field",
    401: "Missing or wrong API key (when the server requires one)",
    404: "No such model",
    413: "The request body is too large",
    500: "A fault of the server; the details are in its log",
    503: "The queue is full, or the server is stopping; see Retry-After",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, each with OpenAI's error body."""
    return {status: {"model": ErrorBody, "description": _ERRORS[status]} for status in statuses}


_REF = "#/components/schemas/{model}"
_STREAMED = (CompletionChunk, ChatChunk)
"""Models only events refer to: FastAPI does not see them, so `install` adds them to the document."""


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (as OpenAPI 3.2 and FastAPI describe them): a chunk, an error, or `[DONE]`."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model="ErrorBody")}]}
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _generation(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation route's answers: `body` as JSON, or with `stream: true` server-sent events of `chunk`."""
    answer = {
        "model": body,
        "description": "The answer as one JSON body; with `stream: true`, server-sent events: `data: {chunk}` "
        "lines, then `data: [DONE]` (an error after the first event is one `data: {error}` event before it)",
        "content": {"text/event-stream": {"itemSchema": _event(chunk)}},
    }
    return {200: answer, **_errors(400, 401, 404, 413, 500, 503)}


COMPLETIONS = _generation(Completion, CompletionChunk)
CHAT = _generation(ChatCompletion, ChatChunk)
MODEL_LIST = {200: {"model": ModelList}, **_errors(401, 500)}
MODEL_CARD = {200: {"model": ModelCard}, **_errors(401, 404, 500)}
HEALTH = {200: {"model": Health}, 503: {"model": Health, "description": "The server is stopping"}, **_errors(500)}
PAGE = {
    200: {
        "description": "A page to try the server in a browser (HTML with its script, nothing fetched from elsewhere)",
        "content": {"text/html": {"schema": {"type": "string"}}},
    },
    **_errors(500),
}
PROMETHEUS = {
    200: {
        "description": "The metrics in Prometheus' text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    },
    **_errors(500),
}


def install(app: FastAPI, model_name: str) -> None:
    """Serve the document without FastAPI's 422 answers (a validation error here is a 400), and with
    the one model name that generation requests may give (any other is a 404)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            components = schema["components"]["schemas"]
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            for request in ("CompletionRequest", "ChatRequest"):
                components[request]["properties"]["model"]["enum"] = [model_name]
            _, streamed = models_json_schema([(model, "serialization") for model in _STREAMED], ref_template=_REF)
            components.update(streamed["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]
