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
from .ends import Ends
from .generation import Generation
from .step import Verifier, start, step


class Batch:
    """Generations decoded together through one verifier; single-threaded (one caller steps it).

    With `prefill_chunk`, a joining prompt is read at most that many tokens a round (all
    joiners together) while other generations are running, so a long prompt delays their
    steps by one chunk's forward pass at a time instead of by its whole prefill.

    `closed`: every generation is added before the first step (a list to decode, not a
    stream of requests). Once none waits, the batch is done when its last row is, so the
    policy values each row's draft tokens by its chance of ending last (decoding/ends.py).
    """

    def __init__(
        self,
        verifier: Verifier,
        drafting: Drafting | None,
        max_batch: int = 1,
        prefill_chunk: int | None = None,
        closed: bool = False,
    ) -> None:
        self.verifier = verifier
        self.drafting = drafting
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._ends = Ends() if closed and drafting is not None else None
        """The closed batch's rows' paces (None for an open one)."""
        self.waiting: deque[Generation] = deque()
        self.prefilling: list[Generation] = []
        self.running: list[Generation] = []
        self.last_width = 0
        """Tokens per row of the last step's forward pass: 1 + the most draft nodes a row sent (0: no step)."""

    def __len__(self) -> int:
        """Generations not finished yet: waiting, reading their prompt, or running."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def add(self, generation: Generation) -> None:
        """Queue `generation`; it joins at a step boundary, in arrival order, when there is room."""
        self.waiting.append(generation)

    def cancel(self, generation: Generation) -> None:
        """End `generation` now, wherever it is; its row leaves the batch at the next step."""
        if generation in self.waiting:
            self.waiting.remove(generation)
            return
        for group in (self.prefilling, self.running):
            if generation in group:
                group.remove(generation)
                self._leave(generation)

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round: read joining prompts (a chunk of them while others run), step the running; new tokens of each.

        A generation whose prompt is now read gets its first token in this round and steps
        from the next one.
        """
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch:
            generation = self.waiting.popleft()
            generation.drafter = self.drafting.open(generation.prompt) if self.drafting is not None else None
            self.verifier.join(generation)
            self.prefilling.append(generation)
        events: list[tuple[Generation, list[int]]] = []
        ready = []
        if self.prefilling:
            firsts = start(self.prefilling, self.verifier, self._allot())
            ready = [generation for generation, kept in zip(self.prefilling, firsts, strict=True) if kept is not None]
            events += [(g, kept) for g, kept in zip(self.prefilling, firsts, strict=True) if kept is not None]
            self.prefilling = [generation for generation in self.prefilling if generation not in ready]
        self.last_width = 0
        if self.running:
            sent_before = [generation.stats.draft_tokens for generation in self.running]
            groups = [self.running] if self.verifier.batched else [[generation] for generation in self.running]
            closing = self._ends is not None and not (self.waiting or self.prefilling or ready)  # all rows step
            stepped = [event for group in groups for event in zip(group, self._step(group, closing), strict=True)]
            if self._ends is not None:
                for generation, kept in stepped:
                    self._ends.stepped(generation, len(kept))
            sent = [g.stats.draft_tokens - before for (g, _), before in zip(stepped, sent_before, strict=True)]
            self.last_width = 1 + max(sent)
            events += stepped
        self.running += ready
        for generation, _ in events:
            if generation.done and generation in self.running:
                self.running.remove(generation)
                self._leave(generation)
        return events

    def _step(self, group: list[Generation], closing: bool) -> list[list[int]]:
        """One step of `group`; `closing`: every row still to end is in it (a closed batch's end is its last row's)."""
        last = self._ends.last(group).tolist() if closing and self._ends is not None and len(group) > 1 else None
        return step(group, self.verifier, self.drafting, last)

    def _allot(self) -> list[int]:
        """Prompt tokens each joining generation reads this round: all of them when nothing else runs."""
        remaining = [len(generation.prompt) - generation.prefilled for generation in self.prefilling]
        if self.prefill_chunk is None or not self.running:
            return remaining
        budget, counts = self.prefill_chunk, []
        for left in remaining:
            counts.append(min(left, budget))
            budget -= counts[-1]
        return counts

    def close(self) -> None:
        """End every generation still here (what a caller that stops early must call)."""
        for generation in [*self.prefilling, *self.running]:
            self._leave(generation)
        self.prefilling.clear()
        self.running.clear()
        self.waiting.clear()

    def _leave(self, generation: Generation) -> None:
        if self._ends is not None:
            self._ends.forget(generation)
        if generation.drafter is not None:
            generation.drafter.close()
            generation.drafter = None
        self.verifier.leave(generation)


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
