"""PromptIndex: one request's prompt, searchable as a trie of its n-grams without a node per n-gram.

Why: storing every n-gram of a prompt as trie nodes cost ngram_length nodes a token (36 by
default, 17 µs a token or more; over a million nodes for a 32k prompt). A suffix array is an implicit
suffix trie instead: every string s that occurs in the prompt is one contiguous range of the
suffixes sorted by their first tokens, the range's size is the number of times s occurs, and
the children of s are the sub-ranges that agree on the token at offset len(s). Kept: the
prompt and its suffix array, int32 each, 8 bytes a token.

Drafting never looks more than `depth_limit` tokens (match + branch length) past the start of
a match, so the suffixes are sorted by their first `depth_limit` tokens only: prefix doubling
then takes at most ⌈log2(depth_limit)⌉ + 2 whole-array numpy sorts (8 for 36 tokens), whatever
the prompt's length or how much of it repeats.

The answers are those a per-request NgramStore of the prompt gives: an n-gram never continues
past a boundary token (end of turn: it may end a draft, but has no children), and none is
longer than `depth_limit` tokens.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .ngrams import PROMPT

Range = tuple[int, int, int]
"""(lo, hi, length): the suffixes at sorted places lo..hi-1 all start with the same `length` tokens."""
GAP = -1
"""Joins prompts inserted for one request: no n-gram spans it, and it is never drafted."""


class PromptIndex:
    """The tokens of one request's prompt and their suffix array, sorted by the first `depth_limit` tokens."""

    __slots__ = ("_boundary", "_limit", "_sa", "_suffixes", "_token", "_tokens")

    def __init__(self, tokens: Sequence[int], depth_limit: int, boundary_ids: Iterable[int] = ()) -> None:
        self._tokens = np.asarray(tokens, dtype=np.int32)
        self._suffixes = _suffix_array(self._tokens, depth_limit)
        self._limit = depth_limit
        self._boundary = frozenset(boundary_ids)
        self._token = memoryview(self._tokens)  # single items as Python ints, several times faster than numpy's
        self._sa = memoryview(self._suffixes)

    def __len__(self) -> int:
        """Tokens indexed (gaps between joined prompts included)."""
        return len(self._tokens)

    def nbytes(self) -> int:
        """Memory held for the index: the two int32 arrays (the rest is a constant few hundred bytes)."""
        return self._tokens.nbytes + self._suffixes.nbytes

    def joined(self, other: PromptIndex) -> PromptIndex:
        """An index of this prompt and `other`'s, separated by a gap, rebuilt whole (prompts rarely come twice)."""
        both = np.concatenate([self._tokens, np.array([GAP], dtype=np.int32), other._tokens])
        return PromptIndex(both, self._limit, self._boundary)

    # ---- the draft-source seam (see sources.py) ---------------------------------------

    def match(self, tail: Sequence[int]) -> Range | None:
        """The range of `tail` if the prompt goes on after it somewhere (a tail with a boundary never does)."""
        if len(tail) >= self._limit or not self._boundary.isdisjoint(tail) or min(tail, default=0) < 0:
            return None
        lo, hi = 0, len(self._tokens)
        for offset, token in enumerate(tail):
            lo, hi = self._narrow(lo, hi, offset, token)
            if lo == hi:
                return None
        if self._continued(lo, hi, len(tail)) == hi:
            return None
        return lo, hi, len(tail)

    @staticmethod
    def count(handle: Range) -> int:
        """Occurrences of the range's string: its size."""
        return handle[1] - handle[0]

    def children(self, handle: Range, limit: int) -> Iterator[tuple[int, int, int, Range]]:
        """(token, count, source flags, range) of the tokens that follow `handle`'s string, most recent first.

        At most `limit` children: the most frequent ones, the latest-seen first among equal
        counts. Why these: drafting keeps the highest pooled counts, so a rare child cut here
        would rarely have been drafted; and the order (latest occurrence first) is the one the
        n-gram store lists children in, so ties break as they did. The work is one vectorised
        pass over the string's occurrences and `limit` Python steps, whatever the prompt's size.
        """
        lo, hi, length = handle
        token_at, sa = self._token, self._sa
        if length >= self._limit or (length and token_at[sa[lo] + length - 1] in self._boundary):
            return
        lo = self._continued(lo, hi, length)
        if lo == hi:
            return
        token = token_at[sa[lo] + length]
        if token == token_at[sa[hi - 1] + length]:  # sorted, so one child: the common case deep in a draft
            yield token, hi - lo, PROMPT, (lo, hi, length + 1)
            return
        starts = self._suffixes[lo:hi]
        following = self._tokens[starts + length]
        edges = np.concatenate(([0], np.flatnonzero(following[1:] != following[:-1]) + 1, [hi - lo]))
        firsts, sizes = edges[:-1], edges[1:] - edges[:-1]
        latest = np.maximum.reduceat(starts, firsts)
        if len(firsts) > limit:  # the most frequent, the latest first among equals (positions are distinct)
            keep = np.argpartition(sizes * len(token_at) + latest, -limit)[-limit:]
            firsts, sizes, latest = firsts[keep], sizes[keep], latest[keep]
        order = np.argsort(-latest)
        firsts, sizes = firsts[order], sizes[order]
        for token, at, size in zip(following[firsts].tolist(), firsts.tolist(), sizes.tolist(), strict=True):
            yield token, size, PROMPT, (lo + at, lo + at + size, length + 1)

    # ---- ranges -----------------------------------------------------------------------

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """The part of lo..hi (suffixes agreeing on their first `offset` tokens) whose next token is `token`."""
        token_at = self._token

        def following(start: int) -> int:
            return token_at[start + offset]

        sa = self._sa
        if lo < hi and sa[lo] + offset == len(token_at):  # the suffix that ends here sorts first
            lo += 1
        lo = bisect_left(sa, token, lo, hi, key=following)
        if lo == hi or token_at[sa[lo] + offset] != token:  # absent: the usual way a match fails
            return lo, lo
        return lo, bisect_right(sa, token, lo + 1, hi, key=following)

    def _continued(self, lo: int, hi: int, length: int) -> int:
        """The first place in lo..hi whose suffix has a token (not the end, not a gap) at offset `length`.

        Within lo..hi the suffix that ends at offset `length` sorts first, then those with a gap.
        """
        token_at, sa = self._token, self._sa
        if lo < hi and sa[lo] + length == len(token_at):
            lo += 1
        if lo < hi and token_at[sa[lo] + length] < 0:
            lo = bisect_left(sa, 0, lo, hi, key=lambda start: token_at[start + length])
        return lo


def _suffix_array(tokens: np.ndarray, depth: int) -> np.ndarray:
    """Start positions sorted by their first `depth` tokens, a shorter suffix before its extensions.

    Prefix doubling: `rank[i]` orders suffix i by its first `known` tokens; pairing it with the
    rank `step` places on orders by the first `known + step`. Ranks are renumbered densely each
    round (so the pair fits an int64), 0 meaning "past the end" so that shorter suffixes sort
    first. It stops at `depth` tokens, or sooner once every suffix has a rank of its own.
    """
    n = len(tokens)
    values, rank = np.unique(tokens, return_inverse=True)
    rank = rank.astype(np.int64) + 1
    known, distinct = 1, len(values)
    while known < depth and distinct < n:
        step = min(known, depth - known)
        after = np.zeros(n, dtype=np.int64)
        after[: n - step] = rank[step:]
        values, rank = np.unique(rank * (n + 1) + after, return_inverse=True)
        rank += 1
        known, distinct = known + step, len(values)
    return np.argsort(rank, kind="stable").astype(np.int32)
