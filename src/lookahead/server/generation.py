"""From a validated OpenAI request to an engine call: prompt ids, token budget, decoding options.

Whatever can be wrong with a request's content is found here, before it queues: a request that
waited for its turn must not then fail on its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from ..config import SEED_LIMIT
from ..decoding.generation import Generation
from ..decoding.sampling import request_options
from .errors import APIError
from .schemas import ChatRequest, CompletionRequest, GenerationRequest

if TYPE_CHECKING:
    from ..engine import LookaheadEngine

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
FALLBACK_CONTEXT = 2048  # for a model that does not state its context length


@dataclass(frozen=True)
class Plan:
    """One request's generations (one per choice), ready to queue."""

    prompt_ids: list[int]
    max_tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    choices: int = 1

    def generations(self, engine: LookaheadEngine) -> list[Generation]:
        """The checked generations of the request: choice i samples with seed + i (mod 2**64) when seeded."""
        seed = self.options.get("seed")
        return [
            engine.prepare(
                self.prompt_ids,
                self.max_tokens,
                **{**self.options, **({} if seed is None else {"seed": (seed + i) % SEED_LIMIT})},
            )
            for i in range(self.choices)
        ]


def plan_completion(engine: LookaheadEngine, request: CompletionRequest) -> Plan:
    try:
        ids = engine.encode(request.prompt)
    except ValueError as err:
        raise APIError(400, f"prompt: {err}", "prompt", "invalid_value") from err
    return _plan(engine, ids, request.max_tokens or COMPLETION_DEFAULT_TOKENS, request, "prompt", "max_tokens")


def plan_chat(engine: LookaheadEngine, request: ChatRequest) -> Plan:
    try:
        ids = engine.chat_ids([message.for_template() for message in request.messages])
    except (ValueError, TemplateError) as err:
        raise APIError(400, f"messages: {err}", "messages", "invalid_value") from err
    limit_param = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    return _plan(engine, ids, request.token_limit, request, "messages", limit_param)


def _plan(
    engine: LookaheadEngine,
    ids: list[int],
    max_tokens: int | None,
    request: GenerationRequest,
    prompt_param: str,
    limit_param: str,
) -> Plan:
    context = engine.max_positions or FALLBACK_CONTEXT
    if len(ids) >= context:
        message = f"the prompt is {len(ids)} tokens long; this model's context is {context} tokens"
        raise APIError(400, message, prompt_param, "context_length_exceeded")
    max_tokens = max_tokens or context - len(ids)
    if len(ids) + max_tokens > context:
        message = (
            f"{limit_param} ({max_tokens}) + the prompt ({len(ids)} tokens) exceeds this model's context of "
            f"{context} tokens; at most {context - len(ids)} new tokens fit"
        )
        raise APIError(400, message, limit_param, "context_length_exceeded")
    vocab = engine.backend.vocab_size
    if bad := [key for key in request.logit_bias or {} if int(key) >= vocab]:
        message = f"logit_bias: token ids outside the vocabulary of {vocab}: {', '.join(bad[:5])}"
        raise APIError(400, message, "logit_bias", "invalid_value")
    return Plan(ids, max_tokens, engine_options(request), request.n or 1)


def engine_options(request: GenerationRequest) -> dict[str, Any]:
    """Keyword arguments for the engine (temperature 0 means greedy; penalties and bias apply to both).

    OpenAI's default temperature is 1, so a request that does not set it samples, as it would there.
    """
    temperature = 1.0 if request.temperature is None else request.temperature
    options = request_options(temperature, request.top_p, seed=request.seed, stop=request.stop)
    if request.presence_penalty:
        options["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        options["frequency_penalty"] = request.frequency_penalty
    if request.logit_bias:
        options["logit_bias"] = {int(token): bias for token, bias in request.logit_bias.items()}
    if (alternatives := logprobs_asked(request)) is not None:
        options["logprobs"] = alternatives
    return options


def logprobs_asked(request: GenerationRequest) -> int | None:
    """Alternatives per token the request wants with its log-probabilities (None: no log-probabilities)."""
    if isinstance(request, ChatRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs if isinstance(request, CompletionRequest) else None
