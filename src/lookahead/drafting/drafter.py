"""The drafting seam: what a step asks of drafters, and the trie drafter that answers.

A `Drafter` serves one request: before each step it proposes its candidate continuations
(likeliest first, each with its chance of acceptance), hears what verification kept, learns
the tokens the request kept, and is closed when the request ends. A `Drafting` is
engine-wide: it opens one drafter per request and decides, for all the rows of a step
together, how much of their candidates is worth the forward pass's cost. The decoding step
knows only these two protocols, so another draft source (a suffix index, a draft model)
plugs in without touching decoding; the trie drafter is the one we ship.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from ..config import LookaheadConfig
from .policy import Calibration, CostModel, DraftPolicy
from .tree import DraftTree
from .trie import TokenTrie


class Drafter(Protocol):
    """One request's draft source."""

    def propose(
        self, context: Sequence[int], room: int, branching: bool, alone: bool = False, least: float = 0.0
    ) -> DraftTree:
        """Candidates for the step whose root is `context[-1]`, likeliest first; `room` tokens may still be emitted.

        `branching` False asks for a single path (the model cannot verify a tree here); `alone`:
        this row is the step's only one; `least`: no node less likely than this can be sent in this
        step (Drafting.least). A drafter may leave out what the step would never send.
        """
        ...

    def verified(self, tree: DraftTree, accepted: Sequence[int], following: np.ndarray | None = None) -> None:
        """What verification kept of the sent `tree` (block indices of the accepted nodes).

        `following` (if the verifier gives it): row i holds the model's likeliest next tokens, likeliest
        first, after block position i (0 the root, i the tree's node i); -1 where unknown.
        """
        ...

    def learn(self, tokens: Sequence[int]) -> None:
        """Tokens the request kept, in order (what a stop discarded is never passed)."""
        ...

    def close(self) -> None:
        """The request ended: release what belongs to it."""
        ...


class Drafting(Protocol):
    """Engine-wide drafting: one drafter per request, and what each step sends of all rows' candidates."""

    def open(self, prompt: Sequence[int]) -> Drafter: ...

    def fit(self, trees: Sequence[DraftTree], context: int, last: Sequence[float] | None = None) -> list[DraftTree]:
        """The part of each row's candidates to verify in this step (a prefix of each); `context`: the longest row's.

        `last`: in a closed batch, each row's chance of ending last (decoding/ends.py), else None.
        """
        ...

    def least(self, rows: int, context: int, last: Sequence[float] | None = None) -> list[float] | None:
        """Per row of a step of `rows` rows, the least chance a node needs for `fit` ever to send it (None: any may
        be sent), so that each row's drafter retrieves no more than the step could take."""
        ...

    def observe(self, trees: Sequence[DraftTree], milliseconds: float, context: int) -> None:
        """The milliseconds the step that verified `trees` together (the longest after `context` tokens) took."""
        ...


class TrieDrafter:
    """One request's view of the shared trie: its prompt n-grams in, its outputs learned, released at close."""

    def __init__(self, trie: TokenTrie, config: LookaheadConfig, policy: DraftPolicy, prompt: Sequence[int]) -> None:
        self.trie = trie
        self.config = config
        self.policy = policy
        self.request = object()
        self.rates = policy.request_rates()
        self._root = -1
        """The root of the step proposed last."""
        self._drafted: list[float] | None = None
        """The chances of the tree proposed last as drafted, where it was sent discounted (policy.path_discount)."""
        self._recycle: tuple[list[int], np.ndarray, list[int], np.ndarray] | None = None
        """From the last verdict: the kept path's tokens and the model's likeliest next tokens after each, then the
        same of the nodes it turned down."""
        trie.insert(prompt, request=self.request)

    def propose(
        self, context: Sequence[int], room: int, branching: bool, alone: bool = False, least: float = 0.0
    ) -> DraftTree:
        config, policy = self.config, self.policy
        self._root = context[-1]
        rates: list[float] = []  # read only once retrieval has an edge to judge: most steps of open text have none

        def chance(flags: int, ratio: float, deep: bool, matched: int, seen: int) -> float:
            if not rates:
                rates.extend(policy.rates(self.rates).tolist())
            return rates[Calibration.cell(flags, ratio, deep, matched, seen)]

        tree = self.trie.retrieve(
            context,
            config.decoding_length,
            min(config.branch_length, room - 1),  # the bonus token takes the last place
            request=self.request,
            match_length=config.match_length,
            branching=branching,
            min_score=max(config.min_score, least),
            chance=chance if policy.adaptive else None,
            floors=(lambda: policy.floors(config.decoding_length, len(context) - 1))
            if alone and policy.adaptive
            else None,
        )
        self._drafted = tree.chances if policy.adaptive and len(tree) else None
        if self._drafted is not None:
            tree.chances = (np.asarray(self._drafted) * policy.discounted(tree, self.rates)).tolist()
        return tree

    def verified(self, tree: DraftTree, accepted: Sequence[int], following: np.ndarray | None = None) -> None:
        if self._drafted is not None and len(tree):  # the policy learns from the chances as drafted
            tree = replace(tree, chances=self._drafted[: len(tree)])
        self.policy.learn(tree, accepted, self.rates)
        if following is not None:
            tokens = np.asarray([self._root, *tree.tokens])
            path = np.asarray([0, *accepted], dtype=np.int64)
            known = following[:, 0] >= 0  # rows the verifier does not know (a replay's) teach nothing
            off = known.copy()
            off[path] = False
            if not known[path].all():  # past a recording's end: the kept path stops at its first unknown row
                path = path[: int(np.argmin(known[path]))]
            self._recycle = (tokens[path].tolist(), following[path], tokens[off].tolist(), following[off])

    def learn(self, tokens: Sequence[int]) -> None:
        """Kept tokens into the trie; into the recycled table what the model expected after every node the last step
        turned down, then after each position kept (none past a stop), so the request's own path has the last word."""
        self.trie.observe(self.request, tokens)
        if self._recycle is not None:
            path, path_rows, off, off_rows = self._recycle
            kept = min(len(tokens), len(path))
            self.trie.recycle([*off, *path[:kept]], np.concatenate([off_rows, path_rows[:kept]]))
            self._recycle = None

    def close(self) -> None:
        self.trie.finish(self.request)


class TrieDrafting:
    """The shared trie, the engine-wide policy and the limits of a LookaheadConfig."""

    def __init__(self, config: LookaheadConfig, trie: TokenTrie, policy: DraftPolicy) -> None:
        self.config = config
        self.trie = trie
        self.policy = policy

    @classmethod
    def from_config(
        cls,
        config: LookaheadConfig,
        boundary_ids: Iterable[int],
        cost: CostModel | None = None,
        trie: TokenTrie | None = None,
    ) -> TrieDrafting:
        """Drafting as `config` says: a new trie unless one is given; `cost` is used by the adaptive policy only."""
        trie = trie if trie is not None else TokenTrie.from_config(config, boundary_ids)
        return cls(config, trie, DraftPolicy(cost if config.policy == "adaptive" else None))

    def open(self, prompt: Sequence[int]) -> TrieDrafter:
        return TrieDrafter(self.trie, self.config, self.policy, prompt)

    def fit(self, trees: Sequence[DraftTree], context: int, last: Sequence[float] | None = None) -> list[DraftTree]:
        return self.policy.fit(trees, context, last)

    def least(self, rows: int, context: int, last: Sequence[float] | None = None) -> list[float] | None:
        return self.policy.least(rows, self.config.decoding_length, context, last)

    def observe(self, trees: Sequence[DraftTree], milliseconds: float, context: int) -> None:
        self.policy.observe(trees, milliseconds, context)
