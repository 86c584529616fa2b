"""Continuous batching: generations join at step boundaries, step together, and leave the moment they end.

A `Batch` keeps a queue of waiting generations and the running ones (at most `max_batch`).
Each `step()` admits waiting generations (opening their drafters and prefilling them), runs
one step (decoding/step.py) over every running generation — one forward pass when the model
batches — and lets finished ones go at once, so no generation waits for another to drain.
`decode`, the loop of a single generation, is a batch of one: one loop for every caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from ..drafting.drafter import Drafting
from .generation import Generation
from .step import Verifier, start, step


class Batch:
    """Generations decoded together through one verifier; single-threaded (one caller steps it)."""

    def __init__(self, verifier: Verifier, drafting: Drafting | None, max_batch: int = 1) -> None:
        self.verifier = verifier
        self.drafting = drafting
        self.max_batch = max_batch
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self.last_width = 0
        """Tokens per row of the last step's forward pass: 1 + the most draft nodes a row sent (0: a prefill)."""

    def __len__(self) -> int:
        """Generations not finished yet, waiting or running."""
        return len(self.waiting) + len(self.running)

    def add(self, generation: Generation) -> None:
        """Queue `generation`; it joins at a step boundary, in arrival order, when there is room."""
        self.waiting.append(generation)

    def cancel(self, generation: Generation) -> None:
        """End `generation` now, waiting or running; its row leaves the batch at the next step."""
        if generation in self.waiting:
            self.waiting.remove(generation)
        elif generation in self.running:
            self.running.remove(generation)
            self._leave(generation)

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round: prefill the generations that join now, or else step every running one; each one's new tokens.

        A joining generation's first token comes out of the round that prefilled it, so its
        time to first token is its prefill; the running generations step in the next round.
        """
        joining = []
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            generation = self.waiting.popleft()
            generation.drafter = self.drafting.open(generation.prompt) if self.drafting is not None else None
            joining.append(generation)
        if joining:
            events = list(zip(joining, start(joining, self.verifier), strict=True))
            self.running += joining
            self.last_width = 0
        else:
            sent_before = [generation.stats.draft_tokens for generation in self.running]
            groups = [self.running] if self.verifier.batched else [[generation] for generation in self.running]
            events = [
                event
                for group in groups
                if group
                for event in zip(group, step(group, self.verifier, self.drafting), strict=True)
            ]
            sent = [g.stats.draft_tokens - before for (g, _), before in zip(events, sent_before, strict=True)]
            self.last_width = 1 + max(sent, default=0)
        for generation, _ in events:
            if generation.done:
                self.running.remove(generation)
                self._leave(generation)
        return events

    def close(self) -> None:
        """End every generation still here (what a caller that stops early must call)."""
        for generation in self.running:
            self._leave(generation)
        self.running.clear()
        self.waiting.clear()

    @staticmethod
    def _leave(generation: Generation) -> None:
        if generation.drafter is not None:
            generation.drafter.close()
            generation.drafter = None
        generation.cache = None


def decode(generation: Generation, verifier: Verifier, drafting: Drafting | None = None) -> Iterator[list[int]]:
    """Prefill, then steps until the generation is done; yields the tokens kept at each.

    With `drafting`, a drafter is opened for the generation and closed however the loop ends
    (exhausted, or closed early by the caller); without, this is plain decoding.
    """
    batch = Batch(verifier, drafting)
    batch.add(generation)
    try:
        while batch:
            for _, kept in batch.step():
                yield kept
    finally:
        batch.close()
