"""Which row of a closed batch ends last: the row whose tokens shorten the whole batch.

A list handed to `generate_batch` is done when its last row is. Once nothing waits to join,
a token accepted on a row that ends well before the last one only lets that row leave
early (its share of a step), while a token of the row that ends last takes a whole round off
the batch. So the policy values each row's draft tokens by the chance that the row ends last
(drafting/policy.py: `worth`), estimated here from each row's room and its recent tokens a step.

Each row's remaining steps are taken as normal, with mean room / pace and a spread from the
variance of its tokens a step (a sum of that many steps) plus a share of the mean for what
the recent pace cannot know (a copy starting or ending); the chance a row ends last is the
chance its draw is the largest, integrated on a grid. Worked example: rows with 100 tokens
of room at 1.1, 1.1 and 3.5 tokens a step (91, 91 and 29 steps to go, give or take 27, 27
and 9) end last with chances 0.4996, 0.4996 and 0.0008.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .generation import Generation

FADE = 0.95
"""A row's pace forgets a step at this rate (copies come in runs: the last twenty steps or so)."""
PRIOR_STEPS = 2.0
"""Steps of one token each that a new row's pace starts from."""
DRIFT = 0.3
"""Spread of a row's remaining steps, as a share of them, for changes its recent pace cannot show."""
GRID = 128
"""Points the chance of ending last is integrated over."""
LOGISTIC = 1.702
"""The normal CDF as a logistic: 1 / (1 + exp(-LOGISTIC z)), within 0.01 everywhere."""


class Pace:
    """One row's tokens a step, fading: their mean and variance."""

    def __init__(self) -> None:
        self.steps = PRIOR_STEPS
        self.tokens = PRIOR_STEPS
        self.squares = PRIOR_STEPS

    def add(self, tokens: int) -> None:
        self.steps = self.steps * FADE + 1
        self.tokens = self.tokens * FADE + tokens
        self.squares = self.squares * FADE + tokens * tokens

    @property
    def mean(self) -> float:
        return self.tokens / self.steps

    @property
    def variance(self) -> float:
        return max(self.squares / self.steps - self.mean**2, 0.0)


def chances_last(remaining: Sequence[float], spread: Sequence[float]) -> np.ndarray:
    """Per row, the chance its remaining steps (normal: mean `remaining`, deviation `spread`) are the most."""
    mean = np.asarray(remaining, dtype=np.float64)
    sd = np.maximum(np.asarray(spread, dtype=np.float64), 0.5)
    if len(mean) == 1:
        return np.ones(1)
    grid = np.linspace((mean - 4 * sd).min(), (mean + 4 * sd).max(), GRID)
    z = LOGISTIC * (grid[None, :] - mean[:, None]) / sd[:, None]
    below = 1 / (1 + np.exp(-np.clip(z, -60, 60)))  # each row's chance of ending by each grid point
    density = below * (1 - below) * LOGISTIC / sd[:, None]
    logs = np.log(np.maximum(below, 1e-300))
    others = np.exp(logs.sum(axis=0)[None, :] - logs)  # all other rows done by then
    last = (density * others).sum(axis=1)
    return last / last.sum() if last.sum() > 0 else np.full(len(mean), 1 / len(mean))


class Ends:
    """The paces of a closed batch's rows, and each row's chance of ending last."""

    def __init__(self) -> None:
        self._paces: dict[Generation, Pace] = {}

    def stepped(self, generation: Generation, tokens: int) -> None:
        """`generation` kept `tokens` tokens in a step."""
        self._paces.setdefault(generation, Pace()).add(tokens)

    def forget(self, generation: Generation) -> None:
        self._paces.pop(generation, None)

    def last(self, generations: Sequence[Generation]) -> np.ndarray:
        """Per generation, the chance it is the last of these to end (its room met at its recent pace)."""
        remaining, spread = [], []
        for generation in generations:
            pace = self._paces.get(generation) or Pace()
            steps = generation.room / pace.mean
            noise = generation.room * pace.variance / pace.mean**3  # of the steps to cover `room` (renewal)
            remaining.append(steps)
            spread.append(np.sqrt(noise + (DRIFT * steps) ** 2))
        return chances_last(remaining, spread)
