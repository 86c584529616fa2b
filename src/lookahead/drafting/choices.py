"""What the model itself chose: the token its output last had after each token.

The trie counts how often text went on one way; this keeps only the model's latest choice
after a token, which is what its next verification most likely repeats. A draft node whose
token is the model's last choice after its parent's token is accepted far more often than
one the model went past (benchmarks/NOTES.md): the trie flags its children by it (FOLLOWED,
OVERRULED) and the calibration keeps the kinds apart. (The choice after the same two tokens
was tried too: no better on the closed replays, worse on code copied at one stream.)

Only the model's output teaches it (any request's answer, an answer learned from a replica),
never a prompt or a corpus: they say what text holds, not what the model chooses. Bounded:
past `most` tokens it forgets the one chosen after longest ago. Not a one-wide RecycledTable:
that table exists only where the verifier hands over its top tokens (recycled drafts on), and
its numpy update costs several times this dict's a call, and this one runs for every row of every
step.

Worked example: after outputs "a b c" and then "x b d", `choice("b")` is "d" (the latest),
`choice("a")` is "b", and `choice("d")` is None (nothing came after it yet).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .ngrams import MAX_TOKEN

MOST = 1 << 18
"""Tokens a table keeps a choice for: more than any tokenizer's vocabulary has (only hostile ids go past it)."""


class ModelChoices:
    """Each token's latest next token in the model's output; the stalest forgotten first past `most`."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self._after: dict[int, int] = {}
        """Token → the token that came after it last; in the order last written (a dict keeps insertion order)."""

    def learn(self, last: int | None, tokens: Sequence[int]) -> None:
        """The model emitted `tokens` right after `last` (None: they open an answer)."""
        after, previous = self._after, last
        for token in tokens:
            if previous is not None:
                after.pop(previous, None)  # written again at the end: the first key stays the stalest
                after[previous] = token
            previous = token
        while len(after) > self.most:
            del after[next(iter(after))]

    def choice(self, token: int) -> int | None:
        """The token the model's output last had after `token` (None: never seen followed)."""
        return self._after.get(token)

    def __len__(self) -> int:
        return len(self._after)

    def largest_token(self) -> int:
        """The largest token id held (-1 if none)."""
        return int(self.column().max(initial=-1))

    def column(self) -> np.ndarray:
        """(token, its latest next token) rows of int32, stalest first: what a trie file keeps."""
        return np.array(list(self._after.items()), dtype=np.int32).reshape(-1, 2)

    @classmethod
    def from_column(cls, rows: np.ndarray, most: int = MOST) -> ModelChoices:
        """The table a `column()` holds; ValueError for anything it could not have written."""
        if rows.ndim != 2 or rows.shape[1] != 2 or rows.dtype != np.int32:
            raise ValueError(f"the model's choices are a {rows.ndim}-d {rows.dtype} array of shape {rows.shape}")
        if len(rows) > most or (rows < 0).any() or (rows > MAX_TOKEN).any():
            raise ValueError(f"the model's choices hold a token id out of range, or more than {most}")
        if len(np.unique(rows[:, 0])) != len(rows):
            raise ValueError("the model's choices name a token twice")
        choices = cls(most)
        choices._after = dict(rows.tolist())
        return choices
