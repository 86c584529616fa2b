"""The seam between drafting and where n-grams are kept: the shared store, a request's prompt index.

`TokenTrie.retrieve` pools the counts of every source that continues the context, so it needs
of each only three things: the place of a context tail, the count at a place, and the next
tokens below a place with their counts and source flags. A place ("handle") means something
to its source only: a node id in the shared NgramStore, a suffix range in a PromptIndex.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from .ngrams import NgramStore


class DraftSource(Protocol):
    """Where drafts can come from: an index of n-grams with counts."""

    def match(self, tail: Sequence[int]) -> Any | None:
        """The handle of `tail` if the source has a token following it, else None."""
        ...

    def count(self, handle: Any) -> int:
        """Times the handle's n-gram was seen."""
        ...

    def children(self, handle: Any, limit: int) -> Iterator[tuple[int, int, int, Any]]:
        """At most `limit` (token, count, source flags, handle) of the tokens seen after the handle's n-gram."""
        ...


class StoreSource:
    """An NgramStore as a draft source: children in list order, most recently seen first.

    A shared node can have thousands of children; the first `limit` of the list are the ones
    seen last, which is what keeps one retrieval cheap whatever the trie's size.
    """

    __slots__ = ("store",)

    def __init__(self, store: NgramStore) -> None:
        self.store = store

    def match(self, tail: Sequence[int]) -> int | None:
        node = self.store.find(tail)
        return node if node is not None and self.store.first[node] else None

    def count(self, handle: int) -> int:
        return self.store.count[handle]

    def children(self, handle: int, limit: int) -> Iterator[tuple[int, int, int, int]]:
        store = self.store
        tokens, counts, flags, following = store.token, store.count, store.source, store.next
        child = store.first[handle]
        for _ in range(limit):
            if not child:
                return
            yield tokens[child], counts[child], flags[child], child
            child = following[child]
