"""Each emitted token with the name of where its draft came from: the picture of what lookahead does.

A token accepted from a draft came from this prompt, from earlier answers, from a corpus or
from the model's recycled guesses; the token a step ends with is the model's own. The view
turns kept tokens into (text, source) pieces as they arrive; a token that ends inside a
character waits for the next one, and the piece is named after the last token in it. It shows
every kept token's text, so where a stop string ended a request the view shows the stop string
too (the answer's text ends before it). Used by `lookahead generate --show-drafts` and the
server's `lookahead_sources` stream (its page uses the same names).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from .drafting.ngrams import SOURCE_NAMES, source_name

COLOURS = {"model": "bright_white", "prompt": "cyan", "answers": "green", "corpus": "magenta", "recycled": "yellow"}
"""Terminal colours per source name (rich's names); every name of SOURCE_NAMES has one."""

CONTEXT = 4
"""Tokens decoded again before a new one, so a piece is the new token's text as it reads in place."""


class SourceView:
    """The (text, source name) pieces of a growing list of tokens, and a count of tokens per source."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._shown = 0
        """Tokens whose text went out."""
        self.counts: Counter[str] = Counter()
        self._last = "model"
        """The source of the last token added (a waiting piece is named after it)."""

    @property
    def taken(self) -> int:
        """Tokens added so far."""
        return len(self._tokens)

    def add(self, tokens: Sequence[int], sources: Sequence[int]) -> list[tuple[str, str]]:
        """Pieces for these new tokens (`sources`: their flags, one each), as far as their text is complete."""
        pieces = []
        for token, flags in zip(tokens, sources, strict=True):
            self._tokens.append(token)
            name = self._last = source_name(flags)
            self.counts[name] += 1
            start = max(0, self._shown - CONTEXT)
            before = self._decode(self._tokens[start : self._shown])
            text = self._decode(self._tokens[start:])
            if text.endswith("\ufffd") or len(text) < len(before):
                continue
            if piece := text[len(before) :]:  # an end-of-sequence token has no text
                pieces.append((piece, name))
            self._shown = len(self._tokens)
        return pieces

    def flush(self) -> list[tuple[str, str]]:
        """At the end: the text of tokens still waiting for the rest of a character (as U+FFFD), if any."""
        if self._shown == len(self._tokens):
            return []
        start = max(0, self._shown - CONTEXT)
        before, text = self._decode(self._tokens[start : self._shown]), self._decode(self._tokens[start:])
        self._shown = len(self._tokens)
        piece = text[len(before) :]
        return [(piece, self._last)] if piece else []

    def summary(self, steps: int) -> str:
        """Tokens, steps and tokens per step, and how many tokens came from each source."""
        total = sum(self.counts.values())
        shares = ", ".join(f"{name} {self.counts[name]}" for name in SOURCE_NAMES if self.counts[name])
        return f"{total} tokens in {steps} steps ({total / max(steps, 1):.2f} tokens per step): {shares}"
