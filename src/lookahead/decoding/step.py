"""One decoding step over a list of generations.

A step asks each generation's drafter for a draft tree, hands all the trees to a Verifier
in one call, tells each drafter what was kept, and appends the emitted tokens up to the
first stop. The Verifier is the only part that differs between a real run (the model:
decoding/verifier.py) and the offline replay (the recorded outputs: bench/replay.py), so the
two cannot drift apart. The loop around steps (joins, leaves; one generation or many) is
batch.py. Nothing here touches torch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from ..drafting.drafter import Drafting
from ..drafting.policy import CostModel, step_width
from ..drafting.tree import DraftTree
from .generation import Generation


class Verdict(NamedTuple):
    """What verification made of one generation's draft."""

    accepted: list[int]
    """Block indices of the accepted draft nodes, from the root's child down."""
    emitted: list[int]
    """The accepted tokens, then the model's own token where the walk stopped."""
    following: np.ndarray | None = None
    """Per position the pass verified, the model's likeliest next tokens there (ids, likeliest first): len(tree) + 1
    rows in block order (the root, then each node), a row of -1 where the verifier does not know it; None where
    the verifier gives none (what recycled drafts learn from)."""


class Verifier(Protocol):
    """The model's side of a step, for a list of generations at once."""

    batched: bool
    """True if the generations of one `verify` call share one forward pass (else one pass each)."""

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        """Read `counts[i]` more prompt tokens of generation i: its first token once its prompt is read, else None."""
        ...

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        """Each generation's verdict on its tree, and the milliseconds the model's work took."""
        ...

    def max_leaves(self, generation: Generation) -> int:
        """Most leaves this generation's next draft tree may have (1: a single path)."""
        ...

    def join(self, generation: Generation) -> None:
        """`generation` is a row of this verifier's batch from now on (its prompt is read next)."""
        ...

    def leave(self, generation: Generation) -> None:
        """`generation` ended: release what the verifier holds for it."""
        ...


def start(
    generations: Sequence[Generation], verifier: Verifier, counts: Sequence[int] | None = None
) -> list[list[int] | None]:
    """Prefill `counts[i]` more prompt tokens of each (default: the rest); the first token of each one now read."""
    if counts is None:
        counts = [len(generation.prompt) - generation.prefilled for generation in generations]
    firsts = verifier.prefill(generations, counts)
    return [None if token is None else g.take([token]) for g, token in zip(generations, firsts, strict=True)]


def step(
    generations: Sequence[Generation],
    verifier: Verifier,
    drafting: Drafting | None = None,
    last: Sequence[float] | None = None,
) -> list[list[int]]:
    """Draft → verify → keep, once for every generation; the tokens each one kept.

    With `drafting`, the rows' candidates are cut together to the width worth its cost,
    and the step's time is reported back to it. `last`: in a closed batch, each row's chance
    of ending last (what its tokens are worth: decoding/ends.py).
    """
    context = longest_context(generations)
    least = drafting.least(len(generations), context, last) if drafting is not None else None
    trees = [
        _propose(generation, verifier, len(generations) == 1, 0.0 if least is None else least[row])
        for row, generation in enumerate(generations)
    ]
    if drafting is not None:
        trees = drafting.fit(trees, context, last)
    verdicts, milliseconds = verifier.verify(generations, trees)
    if drafting is not None:
        drafting.observe(trees, milliseconds, context)
    kept = []
    for generation, tree, (accepted, emitted, following) in zip(generations, trees, verdicts, strict=True):
        stats = generation.stats
        if generation.drafter is not None:
            clock = time.perf_counter()
            generation.drafter.verified(tree, accepted, following)
            stats.draft_s += time.perf_counter() - clock
        stats.steps += 1
        stats.draft_tokens += len(tree)
        stats.accepted_histogram[len(accepted)] += 1
        stats.sent_histogram[len(tree)] += 1
        kept.append(generation.take(emitted, [tree.sources[node - 1] for node in accepted]))  # block i: node i - 1
    return kept


def longest_context(generations: Sequence[Generation]) -> int:
    """Tokens in the longest row's cache at this step: what attention reads, and the padded batch's length."""
    return max(len(generation.tokens) for generation in generations) - 1


def _propose(generation: Generation, verifier: Verifier, alone: bool, least: float) -> DraftTree:
    if generation.drafter is None:
        return DraftTree()
    clock = time.perf_counter()
    leaves = verifier.max_leaves(generation)
    tree = generation.drafter.propose(generation.tokens, generation.room, leaves > 1, alone, least)
    tree = tree.within_leaves(leaves)
    generation.stats.draft_s += time.perf_counter() - clock
    return tree


class Priced:
    """A verifier whose steps are reported to take what `cost` predicts, not what the clock says.

    Replay prices its steps so; a real run priced the same way makes the adaptive policy take
    exactly the replay's decisions, which is how the two are tested against each other.
    """

    def __init__(self, verifier: Verifier, cost: CostModel, packed: bool = False) -> None:
        self.verifier = verifier
        self.cost = cost
        self.packed = packed
        """Price a batch's step by its rows' mean block (packed rows), not the widest."""
        self.spent_ms = 0.0
        """The predicted milliseconds of all steps so far."""

    @property
    def batched(self) -> bool:
        return self.verifier.batched

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        return self.verifier.prefill(generations, counts)

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        verdicts, _ = self.verifier.verify(generations, trees)
        width = step_width(trees, self.packed)
        milliseconds = self.cost.predict(width, len(trees), longest_context(generations))
        self.spent_ms += milliseconds
        return verdicts, milliseconds

    def max_leaves(self, generation: Generation) -> int:
        return self.verifier.max_leaves(generation)

    def join(self, generation: Generation) -> None:
        self.verifier.join(generation)

    def leave(self, generation: Generation) -> None:
        self.verifier.leave(generation)
