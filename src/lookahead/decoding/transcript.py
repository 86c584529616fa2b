"""The new tokens of one request and their text: where it stops, and what may be streamed yet.

A step can accept several tokens at once; a stop (end-of-sequence id, stop token, stop string,
token limit) can fall anywhere among them, so tokens are taken one at a time and the rest of
the step is dropped. Text is decoded incrementally (only the last few tokens are decoded
again), never emits half a character, and holds back any tail that could still become a stop
string, so a streamed text never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

Decode = Callable[[Sequence[int]], str]
FinishReason = Literal["stop", "length"]


def eos_ids(generation_config: Any, tokenizer: Any = None) -> frozenset[int]:
    """End-of-sequence ids as transformers' `generate()` sees them: the generation config's, else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (a bare string is one stop string)."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"stop must be a string or a list of strings, got {item!r}")
        if not item:
            raise ValueError("stop strings must not be empty")
    return items


class Transcript:
    def __init__(self, decode: Decode, max_new_tokens: int, stop_ids: frozenset[int], stops: tuple[str, ...]) -> None:
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._decode = decode
        self._max_new_tokens = max_new_tokens
        self._stop_ids = stop_ids
        self._stops = stops
        self._longest_stop = max(map(len, stops), default=0)
        self._text = ""  # text of tokens[:_read], complete characters only
        self._prefix = 0  # tokens[_prefix:_read] are decoded again as context for the next piece
        self._read = 0
        self._searched = 0  # the text before this offset holds no stop string
        self._cut: int | None = None  # where a stop string begins
        self._streamed = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def extend(self, new: Sequence[int]) -> list[int]:
        """Take one step's tokens up to and including the first that ends the request."""
        kept: list[int] = []
        for token in new:
            self.tokens.append(token)
            kept.append(token)
            if token in self._stop_ids or (self._stops and self._catch_up() and self._stop_found()):
                self.finish_reason = "stop"
            elif len(self.tokens) >= self._max_new_tokens:
                self.finish_reason = "length"
            if self.done:
                break
        return kept

    @property
    def text(self) -> str:
        """The text so far; once done, the whole text, ending before a stop string."""
        if self._cut is not None:
            return self._text[: self._cut]
        if self.done:
            return self._decode(self.tokens)
        self._catch_up()
        return self._text

    def delta(self) -> str:
        """Text not yet handed out that can no longer change."""
        if self.done:
            ready = self.text
            end = len(ready)
        else:
            self._catch_up()
            ready = self._text
            end = len(ready) - self._held_back(ready)
        piece = ready[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return piece

    def _catch_up(self) -> bool:
        """Decode the tokens not yet in the text; False while they end inside a character."""
        if self._read == len(self.tokens):
            return False
        context = self._decode(self.tokens[self._prefix : self._read])
        extended = self._decode(self.tokens[self._prefix :])
        if len(extended) <= len(context) or extended.endswith("\ufffd"):
            return False
        self._text += extended[len(context) :]
        self._prefix, self._read = self._read, len(self.tokens)
        return True

    def _stop_found(self) -> bool:
        start = max(0, self._searched - self._longest_stop + 1)
        hits = [i for stop in self._stops if (i := self._text.find(stop, start)) >= 0]
        self._searched = len(self._text)
        if hits:
            self._cut = min(hits)
        return bool(hits)

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with."""
        for size in range(min(self._longest_stop - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
