"""Drafts for vLLM's speculative step: one chain of draft tokens per running request, cut together by the policy.

vLLM verifies single paths, so each request's drafter is asked for a chain (`branching`
False). Once per engine step the proposer hears what the step just run did — the tokens
each request sampled and how many of the drafts proposed for it the step carried — and
returns the next drafts: every request's chain from the shared trie, then the policy's cut
of all of them together (a prefix of each, possibly empty: a batch where drafting does not
pay runs as plain decoding).

Nothing here imports vLLM; the engine's state arrives as a `Batch` (vllm/runner.py reads it
off vLLM's model runner). Worked example, one request, prompt [5, 6, 7, 5, 6]:

    call 1: Row(sampled=[7]) (the prefill's token)  → opens a drafter on the prompt, learns [7],
            drafts from [..., 6, 7]: the prompt's "7 5 6" gives the chain [5, 6]
    call 2: Row(sampled=[5, 6, 9], verified=2)       → both drafts accepted (2 of 2), learns [5, 6, 9]

The step's cost is priced from the time between calls, which is one whole engine step
(schedule, forward pass, sampling, this proposer): vLLM's forward pass is not ours to time,
and that interval is what a user waits for. The proposer sends nothing until it has timed one
plain step; that price is every width's to start with ("drafting is free"), and the cost
model learns each (rows, width) size online from real steps, so every size worth trying is
tried and then priced as it runs here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import MAX_NGRAM_LENGTH
from ..drafting.drafter import TrieDrafter, TrieDrafting
from ..drafting.policy import CostModel
from ..drafting.tree import DraftTree

TAIL = MAX_NGRAM_LENGTH
"""Tokens of a request's end a row carries: more than any trie matches (its match length is below)."""


@dataclass(frozen=True)
class Row:
    """One running request as the step just run left it."""

    request: str
    prompt: Sequence[int]
    tail: Sequence[int]
    """The last tokens of prompt and output so far (what the step just run sampled included; TAIL of them)."""
    length: int
    """How many tokens prompt and output hold so far."""
    sampled: Sequence[int]
    """What the step just run added (accepted drafts, then the model's own token); empty while the prompt is read."""
    verified: int
    """How many of the drafts last proposed for this request the step carried (vLLM may trim them)."""
    room: int
    """Tokens the request may still emit."""
    drafting: bool = True
    """False: the request asked to be decoded without drafts (it still teaches the trie)."""


@dataclass(frozen=True)
class Batch:
    """What one call of the proposer is told."""

    rows: Sequence[Row]
    finished: Collection[str] = ()
    """Requests that ended since the last call."""
    carried: Mapping[str, int] = field(default_factory=dict)
    """Tokens each request carried through the step just run (its prompt chunk, or 1 + its drafts)."""


@dataclass
class _Request:
    drafter: TrieDrafter
    proposed: DraftTree | None = None
    """The chain proposed last (None before the first)."""
    sent: DraftTree | None = None
    """The part of it the step carried."""


class ChainDrafting:
    """Per-request drafters over one shared trie, their chains cut together each step."""

    def __init__(self, drafting: TrieDrafting, max_tokens: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.drafting = drafting
        self.max_tokens = max_tokens
        """Longest chain a request may be sent (vLLM's num_speculative_tokens)."""
        self.clock = clock
        drafting.policy.packed = True  # vLLM flattens a batch's rows: each pays only for its own drafts
        self._adaptive = drafting.config.policy == "adaptive"
        self._requests: dict[str, _Request] = {}
        self._last_call: float | None = None
        self._last_context = 0
        self.closed = 0
        """Requests closed so far (the trie file is saved when this moves)."""
        self.steady_steps = 0
        """Steps the cost model learned from (no prompt read in them)."""

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def propose(self, batch: Batch) -> list[list[int]]:
        """The draft tokens for each row of `batch` (a chain, maybe empty), in its order."""
        now = self.clock()
        for request in batch.finished:
            self.close(request)
        steady = self._last_call is not None and bool(batch.carried)
        trees: list[DraftTree] = []
        for row in batch.rows:
            state = self._requests.get(row.request)
            if state is None:
                state = self._requests[row.request] = _Request(self.drafting.open(row.prompt))
            heard = self._hear(state, row, batch.carried.get(row.request))
            steady = steady and heard
            if row.sampled and row.room > 1 and row.drafting:
                tree = state.drafter.propose(row.tail, row.room, branching=False).prefix(self.max_tokens)
            else:
                tree = DraftTree()
            trees.append(tree)
        if steady and len(batch.carried) == len(batch.rows):
            self._observe(batch, (now - self._last_call) * 1000.0)
        context = max((row.length for row in batch.rows), default=1) - 1
        if self.drafting.policy.adaptive:
            trees = self.drafting.fit(trees, context)
        elif self._adaptive:
            trees = [DraftTree() for _ in trees]  # plain steps until one is timed: the price every width starts at
        for row, tree in zip(batch.rows, trees, strict=True):
            self._requests[row.request].proposed = tree
        self._last_call, self._last_context = now, context
        return [list(tree.tokens) for tree in trees]

    def _hear(self, state: _Request, row: Row, carried: int | None) -> bool:
        """Tell the drafter what the step kept; False when the step read prompt tokens (not a decoding step)."""
        if not row.sampled:
            return False
        kept = list(row.sampled)
        boundary = next((i for i, token in enumerate(kept) if token in self.drafting.trie.boundary_ids), None)
        if boundary is not None:
            kept = kept[: boundary + 1]  # vLLM cuts the output at the stop; the trie must not learn past it
        if state.proposed is None:  # the prompt's first token
            state.drafter.learn(kept)
            return False
        sent = state.proposed.prefix(row.verified)
        state.sent = sent
        accepted = 0
        while accepted < min(len(sent), len(row.sampled) - 1) and sent.tokens[accepted] == row.sampled[accepted]:
            accepted += 1
        state.drafter.verified(sent, list(range(1, accepted + 1)))
        state.drafter.learn(kept)
        return carried == len(sent) + 1

    def _observe(self, batch: Batch, milliseconds: float) -> None:
        """Price the step just run: its rows' sent chains and the time it took."""
        sent = [self._requests[row.request].sent or DraftTree() for row in batch.rows]
        policy = self.drafting.policy
        if policy.cost is None:
            if not self._adaptive:
                return
            policy.cost = CostModel(
                {1: milliseconds, 2: milliseconds}
            )  # a plain step's time: see the module's docstring
        self.drafting.observe(sent, milliseconds, self._last_context)
        self.steady_steps += 1

    def close(self, request: str) -> None:
        """`request` ended: its drafter releases what belongs to it (unknown ids are ignored)."""
        state = self._requests.pop(request, None)
        if state is not None:
            state.drafter.close()
            self.closed += 1

    def close_all(self) -> None:
        for request in list(self._requests):
            self.close(request)
