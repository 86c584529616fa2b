"""Recycled drafts: for every token, the model's likeliest next tokens the last time it ran after that token.

Each verification pass computes the model's whole next-token distribution at every position
it verifies, and plain decoding throws all of it away but the chosen token. Token Recycling
(Luo et al., ACL 2025) keeps the top k of it, keyed by the token the position holds: the next
time that token is the root of a step (or a draft node), its row is a guess of what follows,
and a guess from the model itself, so it reaches text that was never seen before (open
questions, short code), where retrieval has nothing to copy. Rows are overwritten, not
counted: the latest context is the best guess of the next.

The table learns from every position a pass verifies, as Token Recycling does: the root and the
accepted nodes (the request's true context) and the nodes turned down, whose distributions were
computed in a drafted context that left the request's, and are fresher than what the table held. A
recording of plain decoding has only the first kind, so a replay learns less than a real run and
underestimates recycled drafts (benchmarks/NOTES.md has both).

Worked example, k = 2: after the model read "the cat" and put "sat" (then "is") first, and
after "sat" put "on" (then "down") first, `followers(cat)` is [sat, is] and a draft from a
root "cat" is the tree cat → {sat → {on, down}, is}.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from ..config import MAX_RECYCLED, check_recycled
from .ngrams import MAX_TOKEN

GROWTH = 8192
"""The table grows by this many rows at a time (token ids are not known in advance: a trie has no vocabulary)."""


def rank_ratio(rank: int) -> float:
    """The `ratios` entry of a recycled node at this rank: 1 / (rank + 1) (siblings then share like Zipf's law)."""
    return 1.0 / (rank + 1)


def rank_of(ratio: float) -> int:
    """The rank a recycled node's ratio stands for (the inverse of rank_ratio)."""
    return max(round(1.0 / ratio) - 1, 0) if ratio > 0 else MAX_RECYCLED


class RecycledTable:
    """Token → its k likeliest next tokens (likeliest first; -1 where fewer are known); engine-wide, thread-safe."""

    def __init__(self, k: int, rows: np.ndarray | None = None) -> None:
        check_recycled(k)
        if not k:
            raise ValueError("a recycled table keeps at least one next token per token")
        self.k = k
        self._rows = np.full((0, k), -1, dtype=np.int32) if rows is None else rows
        self._lock = threading.Lock()

    @classmethod
    def from_rows(cls, rows: np.ndarray) -> RecycledTable:
        """A table from a saved array; ValueError for anything `update` could not have written."""
        if rows.ndim != 2 or rows.dtype != np.int32 or not 1 <= rows.shape[1] <= MAX_RECYCLED:
            raise ValueError(f"the recycled table is a {rows.ndim}-d {rows.dtype} array of shape {rows.shape}")
        if rows.shape[0] > MAX_TOKEN + 1 or (rows < -1).any() or (rows > MAX_TOKEN).any():
            raise ValueError("the recycled table holds a token id out of range")
        ordered = np.sort(rows, axis=1)
        if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any():
            raise ValueError("a row of the recycled table names a token twice")
        return cls(int(rows.shape[1]), np.array(rows))

    @property
    def rows(self) -> np.ndarray:
        """A copy of the whole table (row t: what follows token t)."""
        with self._lock:
            return self._rows.copy()

    def update(self, keys: Sequence[int], following: np.ndarray) -> None:
        """Row `keys[i]` becomes `following[i]` (the model's likeliest tokens after it; the first k are kept)."""
        if not len(keys):
            return
        if len(following) != len(keys):
            raise ValueError(f"{len(keys)} tokens but {len(following)} rows of next tokens")
        keys_array = np.asarray(keys, dtype=np.int64)
        with self._lock:
            needed = int(keys_array.max()) + 1
            if needed > len(self._rows):  # in steps of GROWTH rows: a few copies, never far past the vocabulary
                size = min(-(-needed // GROWTH) * GROWTH, MAX_TOKEN + 1)
                grown = np.full((size, self.k), -1, dtype=np.int32)
                grown[: len(self._rows)] = self._rows
                self._rows = grown
            rows = np.full((len(keys_array), self.k), -1, dtype=np.int32)
            given = np.asarray(following)[: len(keys_array), : self.k]
            rows[:, : given.shape[1]] = given
            unique, from_end = np.unique(keys_array[::-1], return_index=True)
            self._rows[unique] = rows[len(rows) - 1 - from_end]  # a repeated key keeps its last row

    def followers(self, token: int) -> list[int]:
        """The tokens seen likeliest after `token`, likeliest first (empty if it was never verified)."""
        with self._lock:  # a row is written in place: never read half of an old row and half of a new one
            if token >= len(self._rows):
                return []
            row = self._rows[token].tolist()
        return row[: row.index(-1)] if -1 in row else row

    def largest_token(self) -> int:
        """The largest token id the table holds, as a key or a follower (-1 if none)."""
        with self._lock:
            keys = np.flatnonzero(self._rows[:, 0] >= 0)
            return max(int(keys[-1]), int(self._rows.max())) if len(keys) else -1

    def __len__(self) -> int:
        """Tokens with a row."""
        with self._lock:
            return int((self._rows[:, 0] >= 0).sum())
