"""How one token is chosen from a node's logits: greedy or sampled, after the logits processors.

Verification asks for the model's choice at draft nodes one at a time along the walk, so
each choice sees exactly the prefix of its own path; processors that read the prefix
(repetition penalty, minimum length, ...) are therefore applied per node, with transformers'
own processor classes. A sampled choice uses one uniform draw from the request's generator
per emitted token, so a seeded request emits the same tokens with or without drafts. Where a
request asks for log-probabilities, every choice also records the model's own distribution at
its position (the log-softmax of the raw logits, before any processor, as vLLM returns by
default): what plain decoding computes, within the float rounding of the pass a token was
verified in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..config import SEED_LIMIT, is_finite_number, is_int


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, checked on creation. temperature == 0 means greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Any integer in [-2**63, 2**64): a negative one is taken modulo 2**64 (its two's complement)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the answer already holds (not the prompt)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per earlier occurrence of the token in the answer."""
    logit_bias: Mapping[int, float] | None = None
    """Token id -> a number in [-100, 100] added to its logit at every position."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not is_finite_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0")
        if self.seed is not None and not (is_int(self.seed) and -SEED_LIMIT // 2 <= self.seed < SEED_LIMIT):
            raise bad("seed", "an integer in [-2**63, 2**64) or None")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_finite_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise bad(name, "a number in [-2, 2]")
        for token, bias in (self.logit_bias or {}).items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias: token ids must be integers >= 0, got {token!r}")
            if not is_finite_number(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {bias!r}")

    @property
    def sampled(self) -> bool:
        return self.do_sample and self.temperature > 0

    def processors(self, prompt_length: int = 0) -> LogitsProcessorList:
        """The processors for these settings, in the order `generate()` applies them (penalties and bias first).

        `prompt_length`: where the answer starts, for the presence and frequency penalties.
        """
        chain = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            chain.append(OccurrencePenalty(self.presence_penalty, self.frequency_penalty, prompt_length))
        if self.logit_bias:
            chain.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in self.logit_bias.items()]))
        if self.sampled:
            if self.temperature != 1.0:
                chain.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                chain.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                chain.append(TopPLogitsWarper(self.top_p))
            if self.min_p > 0.0:
                chain.append(MinPLogitsWarper(self.min_p))
        return chain


class OccurrencePenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties, counted over the answer only (as vLLM and OpenAI do).

    A token's logit loses `presence` if the answer holds it and `frequency` times its count.
    Worked example: answer [5, 7, 5], presence 0.5, frequency 0.25: token 5 loses 1.0, token 7 loses 0.75.
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence = presence
        self.frequency = frequency
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        answer = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, answer, torch.ones_like(answer, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the model, and the likeliest tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability), likeliest first: as many as the request asked for."""


def request_options(
    temperature: float,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> dict[str, Any]:
    """Engine keyword arguments for a client's request (the command line, the server, the benchmark).

    Temperature 0 is greedy, and then top_p, top_k and seed, which only shape sampling, are not
    passed; None leaves a setting to the engine's default.
    """
    options: dict[str, Any] = {}
    if temperature != 0:
        options.update(do_sample=True, temperature=temperature)
        settings = {"top_p": top_p, "top_k": top_k, "seed": seed}
        options.update({name: value for name, value in settings.items() if value is not None})
    if stop:
        options["stop"] = stop
    return options


class TokenChooser:
    """The model's choice at one node: argmax or a sample of the processed distribution."""

    def __init__(
        self, processors: LogitsProcessorList, sample: bool, seed: int | None, logprobs: int | None = None
    ) -> None:
        self.processors = processors
        self.sample = sample
        self.generator = torch.Generator()  # on the CPU: the same seed draws the same numbers on any device
        if seed is not None:
            self.generator.manual_seed(seed % SEED_LIMIT)
        elif sample:  # greedy never draws: no need to gather entropy for it
            self.generator.seed()
        self.logprobs = logprobs
        """Record each choice's log-probability and this many alternatives (None: record nothing)."""
        self.chosen: list[TokenLogprob] = []
        """One record per choice, in order (a generation keeps as many as it kept tokens)."""

    @property
    def plain_argmax(self) -> bool:
        """True when the choice is the raw argmax, which needs no prefix and can be batched."""
        return not self.sample and not self.processors and self.logprobs is None

    def choose(self, logits: torch.Tensor | np.ndarray, prefix: list[int]) -> int:
        """Token for one node whose logits are `logits` (vocab,) after the tokens `prefix`."""
        if self.plain_argmax:  # the first largest (logits are float32 or narrower: as after .float()), no tensor made
            return int(logits.argmax())
        scores = torch.as_tensor(logits).float().unsqueeze(0)
        model = torch.log_softmax(scores[0], -1) if self.logprobs is not None else None  # before any processor
        if self.processors:
            ids = torch.tensor([prefix], dtype=torch.long, device=scores.device)
            scores = self.processors(ids, scores)
        token = self._draw(scores[0]) if self.sample else int(scores.argmax(-1))
        if model is not None:
            self.chosen.append(_record(model, token, self.logprobs))
        return token

    def _draw(self, scores: torch.Tensor) -> int:
        cumulative = torch.softmax(scores.double(), dim=-1).cumsum(0)
        draw = float(torch.rand((), generator=self.generator)) * float(cumulative[-1])
        # right=True: the first token whose cumulative mass exceeds the draw never has zero mass
        token = int(torch.searchsorted(cumulative, torch.tensor([draw], device=cumulative.device), right=True))
        return min(token, cumulative.numel() - 1)


def _record(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    pairs: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = logprobs.topk(min(top, logprobs.numel()))
        pairs = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), pairs)


def argmaxes(logits: torch.Tensor) -> list[int]:
    """Each row's first largest logit's index (greedy decoding's token), as a list."""
    return first_largest(logits).tolist()


def first_largest(logits: torch.Tensor) -> torch.Tensor:
    """Each position's first largest logit's index, int64 of the logits' shape but the last: on a CPU through numpy,
    whose argmax is vectorised where torch's reads a vocabulary several times slower (benchmarks/NOTES.md)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1)
    exact = logits if logits.dtype in (torch.float32, torch.float64, torch.float16) else logits.float()  # bf16: exact
    return torch.as_tensor(exact.numpy().argmax(-1))


def likeliest(logits: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's `k` largest logits, largest first (int32 rows; what recycled drafts learn from)."""
    scores = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits
    return scores.topk(min(k, scores.shape[-1]), dim=-1).indices.to(torch.int32).cpu().numpy()
