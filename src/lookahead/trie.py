"""TokenTrie: n-grams seen before, and the draft trees they suggest.

Two kinds of n-grams live here. Output n-grams (what the model generated, or a corpus) are
shared by every request and stay. Prompt n-grams belong to one request: each request gets a
small private trie of its own, dropped whole by `finish`, so a long prompt leaves nothing
behind and concurrent requests never see each other's prompts.

A node's count is the number of times its n-gram was seen; child count / parent count
estimates the chance that the child token follows, and the product along a path the chance
that a draft path is accepted. Pure Python: no torch, no model.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .draft import DraftTree


class _Ngrams:
    """One trie of n-grams as parallel lists: node 0 is the root."""

    __slots__ = ("children", "counts")

    def __init__(self) -> None:
        self.children: list[dict[int, int] | None] = [None]
        self.counts: list[int] = [0]

    def __len__(self) -> int:
        return len(self.counts) - 1

    def step(self, node: int, token: int) -> int:
        """The child of `node` for `token`, created if missing, its count raised by one."""
        kids = self.children[node]
        if kids is None:
            kids = self.children[node] = {}
        child = kids.get(token)
        if child is None:
            child = kids[token] = len(self.counts)
            self.children.append(None)
            self.counts.append(0)
        self.counts[child] += 1
        return child

    def find(self, tokens: Sequence[int]) -> int | None:
        node = 0
        for token in tokens:
            kids = self.children[node]
            if kids is None or (node := kids.get(token, -1)) < 0:
                return None
        return node


@dataclass
class _Feed:
    """Incremental insertion state of one growing sequence: the open n-gram ends."""

    ngrams: _Ngrams
    length: int
    open_nodes: list[int] = field(default_factory=list)

    def push(self, token: int, boundary: bool) -> None:
        """Extend every open n-gram by `token` and open a new one: O(n-gram length).

        A boundary token (end of turn) ends every open n-gram: inside a chat prompt it
        separates turns, it does not end the prompt.
        """
        ngrams = self.ngrams
        nodes = [ngrams.step(node, token) for node in self.open_nodes[-(self.length - 1) :]]
        nodes.append(ngrams.step(0, token))
        self.open_nodes = [] if boundary else nodes


class TokenTrie:
    """The shared n-gram index of an engine, plus one private prompt trie per live request."""

    def __init__(self, ngram_length: int = 12, boundary_ids: Iterable[int] = ()) -> None:
        if ngram_length < 2:
            raise ValueError(f"ngram_length must be at least 2, got {ngram_length}")
        self.ngram_length = ngram_length
        self.boundary_ids = frozenset(boundary_ids)
        self._shared = _Ngrams()
        self._prompts: dict[Hashable, _Ngrams] = {}
        self._feeds: dict[Hashable, _Feed] = {}
        self._lock = threading.RLock()

    def __len__(self) -> int:
        """Nodes in the shared index (prompt tries of live requests not counted)."""
        return len(self._shared)

    # ---- learning ---------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], request: Hashable | None = None) -> None:
        """Add every n-gram of `tokens`: to `request`'s prompt trie, or shared if no request."""
        with self._lock:
            target = self._shared if request is None else self._prompts.setdefault(request, _Ngrams())
            feed = _Feed(target, self.ngram_length)
            for token in tokens:
                feed.push(token, token in self.boundary_ids)

    def observe(self, request: Hashable, new_tokens: Sequence[int]) -> None:
        """Learn a request's newly accepted output tokens into the shared index, incrementally."""
        with self._lock:
            feed = self._feeds.get(request)
            if feed is None:
                feed = self._feeds[request] = _Feed(self._shared, self.ngram_length)
            for token in new_tokens:
                feed.push(token, token in self.boundary_ids)

    def finish(self, request: Hashable) -> None:
        """Forget a request's prompt n-grams; what it generated stays shared."""
        with self._lock:
            self._prompts.pop(request, None)
            self._feeds.pop(request, None)

    # ---- drafting ---------------------------------------------------------------------

    def retrieve(
        self,
        context: Sequence[int],
        budget: int,
        max_depth: int,
        request: Hashable | None = None,
        match_length: int = 4,
        branching: bool = True,
        min_score: float = 0.0,
    ) -> DraftTree:
        """Best-first draft tree below the longest matched tail of `context`.

        The prompt trie of `request` and the shared index are searched together: a
        candidate's score is its pooled count over its parent's pooled count, times its
        parent's score. At most `budget` nodes, `max_depth` deep; with `branching` off,
        a single path (for models that cannot take a tree mask). The work done is bounded
        by the budget and the fan-out of the visited nodes, not by the trie's size.
        """
        if budget < 1 or max_depth < 1 or not context:
            return DraftTree()
        with self._lock:
            sources = [self._shared]
            if request is not None and request in self._prompts:
                sources.append(self._prompts[request])
            start = self._match(context, sources, match_length)
            if start is None:
                return DraftTree()
            return self._best_first(sources, start, budget, max_depth, branching, min_score)

    def _match(
        self, context: Sequence[int], sources: list[_Ngrams], match_length: int
    ) -> list[tuple[_Ngrams, int]] | None:
        """Nodes of the longest context tail (≤ match_length) that some source continues."""
        for length in range(min(match_length, len(context)), 0, -1):
            tail = context[-length:]
            found = []
            for ngrams in sources:
                node = ngrams.find(tail)
                if node is not None and ngrams.children[node]:
                    found.append((ngrams, node))
            if found:
                return found
        return None

    @staticmethod
    def _best_first(
        sources: list[_Ngrams],
        start: list[tuple[_Ngrams, int]],
        budget: int,
        max_depth: int,
        branching: bool,
        min_score: float,
    ) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        # heap entries: (-score, tie-break, token, parent block index, depth, source nodes)
        heap: list[tuple[float, int, int, int, int, list[tuple[_Ngrams, int]]]] = []
        counter = 0

        def push_children(nodes: list[tuple[_Ngrams, int]], parent: int, score: float, depth: int) -> None:
            nonlocal counter
            total = sum(ngrams.counts[node] for ngrams, node in nodes)
            pooled: dict[int, list[tuple[_Ngrams, int]]] = {}
            weight: dict[int, int] = {}
            for ngrams, node in nodes:
                for token, child in (ngrams.children[node] or {}).items():
                    pooled.setdefault(token, []).append((ngrams, child))
                    weight[token] = weight.get(token, 0) + ngrams.counts[child]
            keep = budget - len(tokens) if branching else 1
            for token in heapq.nlargest(keep, weight, key=weight.__getitem__):
                child_score = score * weight[token] / total
                if child_score > min_score:
                    counter += 1
                    heapq.heappush(heap, (-child_score, counter, token, parent, depth, pooled[token]))

        push_children(start, 0, 1.0, 1)
        while heap and len(tokens) < budget:
            neg_score, _, token, parent, depth, nodes = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            scores.append(-neg_score)
            if depth < max_depth:
                push_children(nodes, len(tokens), -neg_score, depth + 1)
        return DraftTree(tokens, parents, scores)

    # ---- introspection ----------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "shared_nodes": len(self._shared),
                "live_requests": len(self._prompts),
                "prompt_nodes": sum(len(t) for t in self._prompts.values()),
            }
