"""How one token is chosen from a node's logits: greedy or sampled, after the logits processors.

Verification asks for the model's choice at draft nodes one at a time along the walk, so
each choice sees exactly the prefix of its own path; processors that read the prefix
(repetition penalty, minimum length, ...) are therefore applied per node, with transformers'
own processor classes. A sampled choice uses one uniform draw from the request's generator
per emitted token, so a seeded request emits the same tokens with or without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
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
        if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise bad("seed", "an integer in [0, 2**64) or None")

    @property
    def sampled(self) -> bool:
        return self.do_sample and self.temperature > 0

    def processors(self) -> LogitsProcessorList:
        """transformers' processors for these settings, in the order `generate()` applies them."""
        chain = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
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

    def __init__(self, processors: LogitsProcessorList, sample: bool, seed: int | None) -> None:
        self.processors = processors
        self.sample = sample
        self.generator = torch.Generator()  # on the CPU: the same seed draws the same numbers on any device
        if seed is not None:
            self.generator.manual_seed(seed)
        elif sample:  # greedy never draws: no need to gather entropy for it
            self.generator.seed()

    @property
    def plain_argmax(self) -> bool:
        """True when the choice is the raw argmax, which needs no prefix and can be batched."""
        return not self.sample and not self.processors

    def choose(self, logits: torch.Tensor | np.ndarray, prefix: list[int]) -> int:
        """Token for one node whose logits are `logits` (vocab,) after the tokens `prefix`."""
        scores = torch.as_tensor(logits).float().unsqueeze(0)
        if self.processors:
            ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
            scores = self.processors(ids, scores)
        if not self.sample:
            return int(scores.argmax(-1))
        cumulative = torch.softmax(scores[0].double(), dim=-1).cumsum(0)
        draw = float(torch.rand((), generator=self.generator)) * float(cumulative[-1])
        # right=True: the first token whose cumulative mass exceeds the draw never has zero mass
        token = int(torch.searchsorted(cumulative, torch.tensor([draw], device=cumulative.device), right=True))
        return min(token, cumulative.numel() - 1)


def likeliest(logits: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's `k` largest logits, largest first (int32 rows; what recycled drafts learn from)."""
    scores = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits
    return scores.topk(min(k, scores.shape[-1]), dim=-1).indices.to(torch.int32).cpu().numpy()
