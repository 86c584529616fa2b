"""Log-probabilities in OpenAI's two shapes: chat's `content` list and completions' parallel lists.

The values are the engine's (decoding/sampling.py): the model's own log-softmax at each emitted
position, before temperature, penalties or bias, as vLLM returns by default. A token's text is
its own decoding, so a token that ends inside a character shows U+FFFD, and `bytes` are that
text's UTF-8, as for any detokenized stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..decoding.sampling import TokenLogprob


class LogprobFormat:
    """Renders a choice's token records for one endpoint; completions count `text_offset` across chunks."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def text_length(self, records: Sequence[TokenLogprob]) -> int:
        """Characters of these tokens' texts: how far a completion's `text_offset` moves past them."""
        return sum(len(self.text(r.token)) for r in records)

    def body(self, records: Sequence[TokenLogprob], offset: int = 0) -> dict:
        """The `logprobs` object of a choice (or of one stream chunk) holding `records`."""
        if self.chat:
            return {"content": [self._entry(r.token, r.logprob, r.top) for r in records], "refusal": None}
        texts = [self.text(r.token) for r in records]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self.text(token): value for token, value in r.top} for r in records],
            "text_offset": offsets,
        }

    def _entry(self, token: int, logprob: float, top: Sequence[tuple[int, float]] | None) -> dict:
        text = self.text(token)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        if top is not None:
            entry["top_logprobs"] = [self._entry(alternative, value, None) for alternative, value in top]
        return entry
