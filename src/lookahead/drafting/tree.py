"""DraftTree: the candidate continuations verified in one forward pass.

Index 0 of the packed block is the root (the last accepted token, not yet in the KV cache);
draft node i sits at block index i + 1. Parents always come before their children. The tree
is plain data: decoding turns it into attention masks and positions (decoding/masks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    """Token of each draft node."""
    parents: list[int] = field(default_factory=list)
    """Block index of each node's parent: 0 is the root, i + 1 is draft node i."""
    ratios: list[float] = field(default_factory=list)
    """The trie's estimate that the node follows its parent: its count over its parent's count (a node only
    recycled: 1 / (its rank among the model's next tokens + 1))."""
    sources: list[int] = field(default_factory=list)
    """Where each node came from: OR of the source flags (prompt, output, corpus; recycled from the model)."""
    chances: list[float] = field(default_factory=list)
    """The drafter's estimate that each node's path is accepted; nodes come likeliest first."""
    seen: list[int] = field(default_factory=list)
    """How often each node's n-gram was seen, pooled over the trie's sources (0: not from a trie, or only recycled):
    a ratio of one sighting is weaker evidence than the same ratio of many (policy.Calibration)."""
    matched: int = 0
    """How many tokens of the context's end the trie matched to grow it (0: none, or not from a trie): the longer the
    match, the likelier its continuations (policy.Calibration)."""

    def __post_init__(self) -> None:
        count = len(self.tokens)
        if len(self.parents) != count:
            raise ValueError("tokens and parents must have the same length")
        self.ratios = self.ratios or [1.0] * count
        self.sources = self.sources or [0] * count
        self.chances = self.chances or [1.0] * count
        self.seen = self.seen or [0] * count
        if not count == len(self.ratios) == len(self.sources) == len(self.chances) == len(self.seen):
            raise ValueError("every node needs one ratio, one source, one chance and one sighting count")
        for i, parent in enumerate(self.parents):
            if not 0 <= parent <= i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A single path: each token under the one before it, the first under the root."""
        return cls(list(tokens), list(range(len(tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Depth of each draft node; the root's children are at depth 1."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return depths[1:]

    @property
    def scores(self) -> list[float]:
        """The trie's estimate that each node's whole path is accepted: the product of ratios along it."""
        scores = [1.0]
        for ratio, parent in zip(self.ratios, self.parents, strict=True):
            scores.append(scores[parent] * ratio)
        return scores[1:]

    @property
    def is_chain(self) -> bool:
        """True when the draft is a single path, which the ordinary causal mask already fits."""
        return all(parent == i for i, parent in enumerate(self.parents))

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The nodes at indices `keep` (ascending, each with its parent kept), re-indexed."""
        block = {0: 0}
        for position, node in enumerate(keep, start=1):
            block[node + 1] = position
        try:
            parents = [block[self.parents[node]] for node in keep]
        except KeyError:
            raise ValueError("a kept node's parent was not kept") from None
        pick = [self.tokens, self.ratios, self.sources, self.chances, self.seen]
        tokens, ratios, sources, chances, seen = ([column[node] for node in keep] for column in pick)
        return DraftTree(tokens, parents, ratios, sources, chances, seen, self.matched)

    def prefix(self, size: int) -> DraftTree:
        """The first `size` nodes: a tree as they are, since parents come before their children."""
        if size >= len(self.tokens):
            return self
        return DraftTree(self.tokens[:size], self.parents[:size], self.ratios[:size], self.sources[:size],
                         self.chances[:size], self.seen[:size], self.matched)  # fmt: skip

    def within_leaves(self, most: int) -> DraftTree:
        """The longest prefix with at most `most` leaves (a verifier may give each leaf a scarce resource)."""
        has_child = [False] * (len(self.tokens) + 1)
        leaves = 0
        for index, parent in enumerate(self.parents):
            leaves += parent == 0 or has_child[parent]  # a new leaf, unless it extends a leaf
            has_child[parent] = True
            if leaves > most:
                return self.prefix(index)
        return self

    def children(self) -> list[dict[int, int]]:
        """Per block index, the map token -> block index of its child."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self.tokens) + 1)]
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            kids[parent].setdefault(token, i + 1)
        return kids

    def ancestor_matrix(self) -> np.ndarray:
        """Boolean (n+1, n+1): row i marks the block entries that block entry i may attend to."""
        size = len(self.tokens) + 1
        allowed = np.zeros((size, size), dtype=bool)
        allowed[0, 0] = True
        for i, parent in enumerate(self.parents, start=1):
            allowed[i] = allowed[parent]
            allowed[i, i] = True
        return allowed
