"""NgramStore: one trie of token n-grams in flat typed arrays, with counts, weights and eviction.

Why arrays: a dict of children per node cost about 490 bytes a node. Here a node is one row of
parallel `array.array` columns (token, parent, count, weight, source, and first-child /
next-sibling / previous-sibling links) plus one entry in a single dict that maps
(parent, token), packed into one int, to the child's row: under 200 bytes a node (measured),
and a child lookup is still one dict probe. `array.array` rather than numpy for the columns because
reading and writing single items from Python is several times faster; numpy is used where
whole columns are processed at once (eviction, save, load).

Freed rows go on a free list and are reused, so node ids are stable between evictions.
A node's children form a linked list kept in most-recently-seen order (a child seen again
moves to the front), so the frequent ones are near the front and drafting can look at the
first few children of a node that has thousands.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np

TOKEN_BITS = 24
"""Tokens are packed below the parent id in the index key, so ids must be below 2**24."""
MAX_TOKEN = (1 << TOKEN_BITS) - 1

OUTPUT, CORPUS, PROMPT, RECYCLED, FOLLOWED, OVERRULED = 1, 2, 4, 8, 16, 32
"""Source flags of a node: seen in a model's output, inserted from a corpus, in the request's prompt; a draft
node may also be RECYCLED, among the model's own likeliest next tokens (recycled.py), and FOLLOWED or OVERRULED:
the model's output last had this token, or another, after its parent's token (choices.py; never trie nodes' flags)."""
SOURCE_NAMES = ("model", "prompt", "answers", "corpus", "recycled")
"""What a token's source flags are called where people see them (source_name); "model": no draft, the step's own."""


def source_name(flags: int) -> str:
    """The one name of a node's flags, the likeliest to be right first: prompt, earlier answers, corpus, recycled."""
    for flag, name in ((PROMPT, "prompt"), (OUTPUT, "answers"), (CORPUS, "corpus"), (RECYCLED, "recycled")):
        if flags & flag:
            return name
    return "model"


SHARED_SOURCES = (OUTPUT, CORPUS, OUTPUT | CORPUS)
"""The flags a shared (saved) node can have: prompt n-grams are never shared."""
MAX_COUNT = 1 << 53
"""Largest count a loaded node may have: more sightings than any corpus has tokens, and far
enough below the int64 limit that counting on can never overflow."""


class NgramStore:
    """Rows of a token trie; row 0 is the root. A link of 0 means "none" (the root is nobody's child)."""

    __slots__ = ("count", "first", "free", "index", "next", "parent", "prev", "source", "token", "weight")

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.token = array("i", [-1])  # -1 marks the root and free rows
        self.parent = array("i", [0])
        self.count = array("q", [0])
        self.weight = array("d", [0.0])
        self.source = bytearray(1)
        self.first = array("i", [0])
        self.next = array("i", [0])
        self.prev = array("i", [0])
        self.free = array("i")

    def __len__(self) -> int:
        """Nodes, the root not counted."""
        return len(self.index)

    # ---- learning ---------------------------------------------------------------------

    def advance(self, nodes: Sequence[int], token: int, weight: float, source: int) -> list[int]:
        """The child for `token` of each of `nodes` (created if missing), each counted once more."""
        index, count, weights, sources = self.index, self.count, self.weight, self.source
        first, following, previous = self.first, self.next, self.prev
        children = []
        for node in nodes:
            key = node << TOKEN_BITS | token
            child = index.get(key)
            if child is None:
                child = index[key] = self._new(node, token, weight, source)
            else:
                count[child] += 1
                weights[child] += weight
                sources[child] |= source
                head = first[node]
                if head != child:  # move to the front: frequent children stay near it
                    before, after = previous[child], following[child]
                    following[before] = after
                    if after:
                        previous[after] = before
                    following[child] = head
                    previous[head] = child
                    previous[child] = 0
                    first[node] = child
            children.append(child)
        return children

    def _new(self, node: int, token: int, weight: float, source: int) -> int:
        """A row for a first sighting, linked in as the newest child of `node`."""
        first, following, previous = self.first, self.next, self.prev
        head = first[node]
        if self.free:
            child = self.free.pop()
            self.token[child] = token
            self.parent[child] = node
            self.count[child] = 1
            self.weight[child] = weight
            self.source[child] = source
            first[child] = 0
            following[child] = head
            previous[child] = 0
        else:
            child = len(first)
            self.token.append(token)
            self.parent.append(node)
            self.count.append(1)
            self.weight.append(weight)
            self.source.append(source)
            first.append(0)
            following.append(head)
            previous.append(0)
        if head:
            previous[head] = child
        first[node] = child
        return child

    # ---- reading ----------------------------------------------------------------------

    def find(self, tokens: Sequence[int]) -> int | None:
        """The node of the n-gram `tokens`, or None."""
        index, node = self.index, 0
        for token in tokens:
            node = index.get(node << TOKEN_BITS | token)
            if node is None:
                return None
        return node

    def children(self, node: int) -> Iterator[tuple[int, int]]:
        """(token, child) pairs below `node`, most recently seen first."""
        tokens, following = self.token, self.next
        child = self.first[node]
        while child:
            yield tokens[child], child
            child = following[child]

    def path(self, node: int) -> list[int]:
        """Tokens from the root down to `node`."""
        tokens = []
        while node:
            tokens.append(self.token[node])
            node = self.parent[node]
        return tokens[::-1]

    def live(self) -> np.ndarray:
        """Ids of all nodes, the root not counted."""
        return np.flatnonzero(np.frombuffer(self.token, dtype=np.int32) >= 0)

    def depths(self) -> np.ndarray:
        """Depth of every row (0 for the root and free rows), by pointer jumping.

        Each whole-column pass doubles how far up every row has counted, so the deepest path
        of d nodes takes log2(d) passes, whatever the row order (freed rows are reused, so a
        parent can come after its child). A pass per level made a 200,000-node chain take a
        minute.
        """
        live = np.frombuffer(self.token, dtype=np.int32) >= 0
        above = np.where(live, np.frombuffer(self.parent, dtype=np.int32), 0)  # free rows keep stale parents
        depth = live.astype(np.int32)  # edges counted from each row up to the row `above` it
        while above.any():
            depth += depth[above]
            above = above[above]
        return depth

    def nbytes(self) -> int:
        """Memory held, estimated: columns, the index's table, and its key and value int objects."""
        columns = sum(a.itemsize * a.buffer_info()[1] for a in (self.token, self.parent, self.count, self.weight))
        columns += len(self.source) + 4 * (len(self.first) * 3 + len(self.free))
        table = self.index.__sizeof__()
        return columns + table + 64 * len(self.index)  # two heap ints of 32 bytes per entry

    # ---- forgetting -------------------------------------------------------------------

    def evict(self, keep: int) -> np.ndarray:
        """Remove the lowest-weight nodes, and every node below a removed one, until ≤ `keep` remain.

        Returns the removed ids (sorted), so callers can drop references to them.
        """
        excess = len(self) - keep
        if excess <= 0:
            return np.empty(0, dtype=np.int64)
        tokens = np.frombuffer(self.token, dtype=np.int32).copy()
        parents = np.frombuffer(self.parent, dtype=np.int32).copy()
        weights = np.frombuffer(self.weight, dtype=np.float64)
        live = np.flatnonzero(tokens >= 0)
        dead = np.zeros(len(tokens), dtype=bool)
        dead[live[np.argpartition(weights[live], excess - 1)[:excess]]] = True
        del weights  # release the buffer: the columns may grow again
        while True:  # a child never outlives its parent; one pass per trie level
            orphans = dead[parents] & ~dead & (tokens >= 0)
            if not orphans.any():
                break
            dead |= orphans
        removed = np.flatnonzero(dead)
        self._unlink(removed.tolist(), dead.tobytes())
        return removed

    def _unlink(self, removed: list[int], dead: bytes) -> None:
        index, token, parent, first, following, previous = (
            self.index, self.token, self.parent, self.first, self.next, self.prev
        )  # fmt: skip
        for node in removed:
            up = parent[node]
            del index[up << TOKEN_BITS | token[node]]
            token[node] = -1
            if not dead[up]:  # a removed parent's children all go too: no need to relink them
                after, before = following[node], previous[node]
                if before:
                    following[before] = after
                else:
                    first[up] = after
                if after:
                    previous[after] = before
        self.free.extend(removed)

    def rescale(self, factor: float) -> None:
        """Multiply every weight by `factor` (keeps decayed weights inside float range)."""
        self.weight = array("d", (np.frombuffer(self.weight, dtype=np.float64) * factor).tobytes())

    # ---- whole-store copies (save / load) ---------------------------------------------

    def export(self) -> dict[str, np.ndarray]:
        """Live nodes renumbered 1..n level by level, siblings in list order: the columns a file stores.

        `from_columns` links siblings in row order, so a loaded store lists children (and so
        breaks ties between equal counts) exactly as this one does.
        """
        first, following = self.first, self.next
        rows: list[int] = []
        level = [0]
        while level:
            below = []
            for node in level:
                child = first[node]
                while child:
                    below.append(child)
                    child = following[child]
            rows += below
            level = below
        order = np.array(rows, dtype=np.int64)
        renumber = np.zeros(len(self.token), dtype=np.int64)
        renumber[order] = np.arange(1, len(order) + 1)
        return {
            "token": np.frombuffer(self.token, dtype=np.int32)[order].copy(),
            "parent": renumber[np.frombuffer(self.parent, dtype=np.int32)[order]].astype(np.int32),
            "count": np.frombuffer(self.count, dtype=np.int64)[order].copy(),
            "weight": np.frombuffer(self.weight, dtype=np.float64)[order].copy(),
            "source": np.frombuffer(self.source, dtype=np.uint8)[order].copy(),
        }

    @classmethod
    def from_columns(cls, columns: dict[str, np.ndarray]) -> NgramStore:
        """A store from `export`'s columns; raises ValueError, naming a bad node, if they do not form a trie."""
        _check_columns(columns)
        tokens, parents = columns["token"], columns["parent"].astype(np.int64)
        n = len(tokens)
        rows = np.arange(1, n + 1)
        store = cls()
        keys = (parents << TOKEN_BITS | tokens.astype(np.int64)).tolist()
        store.index = dict(zip(keys, rows.tolist(), strict=True))
        if len(store.index) != n:
            raise ValueError("the same n-gram is stored twice")
        store.token = array("i", np.concatenate([[-1], tokens]).astype(np.int32).tobytes())
        store.parent = array("i", np.concatenate([[0], parents]).astype(np.int32).tobytes())
        store.count = array("q", np.concatenate([[0], columns["count"]]).astype(np.int64).tobytes())
        store.weight = array("d", np.concatenate([[0.0], columns["weight"]]).astype(np.float64).tobytes())
        store.source = bytearray(np.concatenate([[0], columns["source"]]).astype(np.uint8).tobytes())
        # sibling links: rows grouped by parent, in row order
        order = np.lexsort((rows, parents))
        grouped_parents = parents[order]
        starts = np.ones(n, dtype=bool)
        starts[1:] = grouped_parents[1:] != grouped_parents[:-1]
        ends = np.ones(n, dtype=bool)
        ends[:-1] = starts[1:]
        first, following, previous = (np.zeros(n + 1, dtype=np.int32) for _ in range(3))
        grouped = rows[order]
        first[grouped_parents[starts]] = grouped[starts]
        following[grouped[~ends]] = grouped[1:][~ends[:-1]]
        previous[grouped[~starts]] = grouped[:-1][~starts[1:]]
        store.first = array("i", first.tobytes())
        store.next = array("i", following.tobytes())
        store.prev = array("i", previous.tobytes())
        return store


def _check_columns(columns: dict[str, np.ndarray]) -> None:
    """ValueError unless the columns are a trie `export` could have written (they may come from a file)."""
    tokens, parents, counts, weights = (columns[name] for name in ("token", "parent", "count", "weight"))
    n = len(tokens)
    if any(len(columns[name]) != n for name in ("parent", "count", "weight", "source")):
        raise ValueError("columns differ in length")
    _refuse((tokens < 0) | (tokens > MAX_TOKEN), tokens, "token id", f"must be in [0, {MAX_TOKEN}]")
    _refuse((parents < 0) | (parents > np.arange(n)), parents, "parent", "must come before the node")
    _refuse((counts < 1) | (counts > MAX_COUNT), counts, "count", f"must be in [1, 2**{MAX_COUNT.bit_length() - 1}]")
    above = np.concatenate([[MAX_COUNT], counts])[parents]  # the root's count bounds nothing
    _refuse(counts > above, counts, "count", "must not exceed its parent's")
    _refuse(~np.isfinite(weights) | (weights < 0), weights, "weight", "must be finite and not negative")
    flags = columns["source"]
    _refuse(~np.isin(flags, SHARED_SOURCES), flags, "source flags", f"must be one of {SHARED_SOURCES}")


def _refuse(bad: np.ndarray, values: np.ndarray, name: str, rule: str) -> None:
    """ValueError naming the first node (1-based, as in a file) where `bad` holds."""
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"node {row + 1}: {name} {values[row].item()!r} {rule}")
