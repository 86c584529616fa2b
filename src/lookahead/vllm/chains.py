"""Drafts for vLLM's speculative step: one chain of draft tokens per running request, cut together by the policy.

vLLM verifies single paths, so each request's drafter is asked for a chain (`branching`
False). Once per engine step the proposer hears what the step just run did — the tokens
each request sampled and how many of the drafts proposed for it the step carried — and
returns the next drafts: every request's chain from the shared trie, then the policy's cut
of all of them together (a prefix of each, possibly empty: a batch where drafting does not
pay runs as plain decoding).

Nothing here imports vLLM; the engine's state arrives as a `Batch` (vllm/runner.py reads it
off vLLM's model runner). Worked example, one request, prompt [5, 6, 7, 5, 6], the fixed policy
(the adaptive one sends nothing until it has timed a plain step):

    call 1: Row(sampled=[7]) (the prefill's token)  → opens a drafter on the prompt, learns [7],
            drafts from [..., 6, 7]: the prompt's "7 5 6" gives the chain [5, 6]
    call 2: Row(sampled=[5, 6, 9], verified=2)       → both drafts accepted (2 of 2), learns [5, 6, 9]

The step's cost is priced from the time between calls, which is one whole engine step
(schedule, forward pass, sampling, this proposer): vLLM's forward pass is not ours to time,
and that interval is what a user waits for. The proposer sends nothing until it has timed one
plain step; from then on a step is priced as fixed milliseconds plus milliseconds per token
it carries (`TokensCost`), both fitted online to the steps timed. (A first version priced
every size at that first timed step's price and learned each size once tried, so the tokens
within a size looked free and under load it sent more drafts than paid: benchmarks/NOTES.md.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import MAX_NGRAM_LENGTH
from ..drafting.drafter import TrieDrafter, TrieDrafting
from ..drafting.policy import BASE_CONTEXT
from ..drafting.tree import DraftTree

TAIL = MAX_NGRAM_LENGTH
"""Tokens of a request's end a row carries: more than any trie matches (its match length is below)."""


class TokensCost:
    """A step's price as fixed milliseconds plus milliseconds per token it carries, all rows together.

    vLLM runs a batch as one flat sequence, so a step costs by its tokens in all, whatever the
    rows (16 rows of 1 token and 4 rows of 4 cost alike), and every draft token costs its share
    of compute: on a CPU a 16-row step costs several one-row steps, so 16 rows of drafts are
    far from free; on a GPU they nearly are. Both parts are fitted by least squares to the
    steps timed here, each step's weight fading by FORGET per later step: plain steps of
    different row counts already show the price of a token, drafted steps refine it. Until
    they do, the price of a token leans on a cautious prior: half the first timed step's price
    per token, as if that step had carried at least PRIOR_TOKENS. So while the steps seen hardly
    differ in size it stays near the prior, and a price that rises with the context moves the
    fixed part only.
    """

    FORGET = 0.99
    """A step's weight in the fit fades by this much for every later step: the price follows load and context."""
    PRIOR_TOKENS = 8
    """The prior prices a token as if the first timed step had carried at least this many."""
    PRIOR_STRENGTH = 64.0
    """What the prior weighs in the fit of the per-token price: as much as one step √PRIOR_STRENGTH tokens off
    the steps' mean."""
    OUTLIER = 5.0
    """A step this many times off its price is a pause, ignored once the fit rests on STEADY steps (before, the
    price may be that far off, and the step is the evidence) — unless OUTLIERS_IN_A_ROW say the price moved."""
    STEADY = 8.0
    OUTLIERS_IN_A_ROW = 3

    def __init__(self, tokens: int, milliseconds: float) -> None:
        self.prior_per_token = milliseconds / (2 * max(tokens, self.PRIOR_TOKENS))
        self.per_token = self.prior_per_token
        self.fixed = milliseconds - self.per_token * tokens
        self._sums = np.zeros(5)
        """Faded sums over the steps: weight, tokens, tokens², milliseconds, tokens x milliseconds."""
        self._outliers = 0

    def predict_widths(self, widths: Sequence[float], rows: int = 1, context: int = BASE_CONTEXT) -> np.ndarray:
        """Milliseconds of a step of `rows` rows carrying `widths` tokens a row (their mean)."""
        return self.fixed + self.per_token * np.asarray(widths, dtype=np.float64) * rows

    def predict(self, width: float, rows: int = 1, context: int = BASE_CONTEXT) -> float:
        return float(self.predict_widths([width], rows, context)[0])

    def observe(self, width: float, milliseconds: float, rows: int = 1, context: int = BASE_CONTEXT) -> None:
        """Fit both parts again with a step of `rows` rows carrying `width` tokens a row (mean) that took this long."""
        ratio = milliseconds / max(self.predict(width, rows), 1e-6)
        if self._sums[0] >= self.STEADY and not 1 / self.OUTLIER < ratio < self.OUTLIER:
            self._outliers += 1
            if self._outliers < self.OUTLIERS_IN_A_ROW:
                return
        self._outliers = 0
        tokens = width * rows
        self._sums = self._sums * self.FORGET + [1.0, tokens, tokens * tokens, milliseconds, tokens * milliseconds]
        weight, tokens_sum, squares, total, products = self._sums
        spread = squares - tokens_sum * tokens_sum / weight  # weight x the variance of the token counts
        covariance = products - tokens_sum * total / weight
        prior = self.PRIOR_STRENGTH * self.prior_per_token
        self.per_token = max((covariance + prior) / (spread + self.PRIOR_STRENGTH), 0.0)
        self.fixed = (total - self.per_token * tokens_sum) / weight
        if self.fixed < 0:  # a line through the origin fits best: refit the per-token price alone
            self.fixed, self.per_token = 0.0, max((products + prior) / (squares + self.PRIOR_STRENGTH), 0.0)


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
    stops: frozenset[int] = frozenset()
    """Tokens that end the request (vLLM's stop ids: its EOS unless ignored, and the request's own)."""


@dataclass(frozen=True)
class Batch:
    """What one call of the proposer is told."""

    rows: Sequence[Row]
    finished: Collection[str] = ()
    """Requests that ended since the last call."""
    carried: Mapping[str, int] = field(default_factory=dict)
    """Tokens each request carried through the step just run (its prompt chunk, or 1 + its drafts)."""
    live: Collection[str] | None = None
    """Every request vLLM still holds, running or not (None: not known). Any other ended: vLLM does not call the
    proposer after a step that scheduled nothing, so the last finished ids of a burst never arrive."""


@dataclass
class _Request:
    drafter: TrieDrafter
    proposed: DraftTree | None = None
    """The chain proposed last (None before the first)."""
    sent: DraftTree = field(default_factory=DraftTree)
    """The part of it the step carried."""
    length: int = 0
    """Tokens the request held at the last call (0: none yet)."""


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
        """Requests closed so far."""
        self.steady_steps = 0
        """Steps the cost model learned from (no prompt read in them)."""

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    def propose(self, batch: Batch) -> list[list[int]]:
        """The draft tokens for each row of `batch` (a chain, maybe empty), in its order."""
        now = self.clock()
        ended = set(batch.finished)
        if batch.live is not None:
            ended.update(request for request in self._requests if request not in batch.live)
        for request in ended:
            self.close(request)
        steady = self._last_call is not None
        states = []
        for row in batch.rows:
            state = self._requests.get(row.request)
            if state is None:
                state = self._requests[row.request] = _Request(self.drafting.open(row.prompt))
            heard = self._hear(state, row, batch.carried.get(row.request))
            steady = steady and heard
            states.append(state)
        # The step just run is priced before retrieval, so the floors a row alone stops at come from the fit's prices.
        if steady and batch.rows and len(batch.carried) == len(batch.rows):
            self._observe(batch, (now - self._last_call) * 1000.0)
        alone = len(batch.rows) == 1  # its price decides alone: retrieval may stop at its floors
        context = max((row.length for row in batch.rows), default=1) - 1
        least = self.drafting.least(len(batch.rows), context) or [0.0] * len(batch.rows)  # rows together: theirs
        trees: list[DraftTree] = []
        for row, state, floor in zip(batch.rows, states, least, strict=True):
            if row.sampled and row.room > 1 and row.drafting:
                room = min(row.room, self.max_tokens + 1)  # retrieved no deeper than the chain vLLM takes
                trees.append(state.drafter.propose(row.tail, room, branching=False, alone=alone, least=floor))
            else:
                trees.append(DraftTree())
        if self.drafting.policy.adaptive:
            trees = self.drafting.fit(trees, context)
        elif self._adaptive:
            trees = [DraftTree() for _ in trees]  # plain steps until one is timed: the price every width starts at
        for row, tree in zip(batch.rows, trees, strict=True):
            self._requests[row.request].proposed = tree
        self._last_call, self._last_context = now, context
        return [list(tree.tokens) for tree in trees]

    def _hear(self, state: _Request, row: Row, carried: int | None) -> bool:
        """Tell the drafter what the step kept; False unless the step was one plain or drafted step of this row
        (it read prompt tokens, or vLLM ran steps without calling the proposer)."""
        if not row.sampled:
            return False
        missed = row.length - len(row.sampled) - state.length if state.length else 0
        state.length = row.length
        kept = list(row.sampled)
        stop = next((i for i, token in enumerate(kept) if token in row.stops), None)
        if stop is not None:
            kept = kept[: stop + 1]  # vLLM ends the output at the stop; the trie must not learn past it
        if state.proposed is None or missed:  # no chain proposed yet, or steps vLLM ran without us
            earlier = list(row.tail[-(missed + len(row.sampled)) : -len(row.sampled)]) if missed > 0 else []
            state.drafter.learn(earlier + kept)
            state.sent = DraftTree()
            return False
        sent = state.sent = state.proposed.prefix(row.verified)
        accepted = 0
        while accepted < min(len(sent), len(row.sampled) - 1) and sent.tokens[accepted] == row.sampled[accepted]:
            accepted += 1
        state.drafter.verified(sent, list(range(1, accepted + 1)))
        state.drafter.learn(kept)
        return carried == len(sent) + 1

    def _observe(self, batch: Batch, milliseconds: float) -> None:
        """Price the step just run: its rows' sent chains and the time it took."""
        sent = [self._requests[row.request].sent for row in batch.rows]
        policy = self.drafting.policy
        if policy.cost is None:
            if not self._adaptive:
                return
            policy.cost = TokensCost(len(batch.rows), milliseconds)  # a plain step: see the module's docstring
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
