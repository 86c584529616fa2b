"""One sequence being decoded, and what it reports when it ends.

A `Generation` is all the state of one request between steps: its tokens so far, where it
stops (the transcript), how it chooses tokens and its drafter. Its KV cache is its verifier's
(from `join` to `leave`), not here. The step works
on a list of them, so a batch is a longer list, not another architecture.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .transcript import FinishReason, Transcript

if TYPE_CHECKING:
    from ..drafting.drafter import Drafter
    from .sampling import TokenChooser, TokenLogprob


@dataclass
class GenerationStats:
    """Where a generation's time went and how much each forward pass earned."""

    steps: int = 0
    """Forward passes after prefill."""
    new_tokens: int = 0
    draft_tokens: int = 0
    """Draft nodes sent to the model, summed over steps."""
    accepted_histogram: Counter[int] = field(default_factory=Counter)
    """Draft tokens accepted per step (the bonus token not counted) → number of steps."""
    sent_histogram: Counter[int] = field(default_factory=Counter)
    """Draft tokens sent per step → number of steps (a step's forward pass is one wider)."""
    prefill_s: float = 0.0
    draft_s: float = 0.0
    """The drafter's time: proposing, and learning from each verdict."""
    forward_s: float = 0.0
    """The model's forward passes after prefill (on an accelerator: launching them)."""
    verify_s: float = 0.0
    """Choosing the model's token at each visited node and walking the tree (on an accelerator,
    this is also where the wait for the forward pass shows)."""
    compact_s: float = 0.0
    """Keeping the accepted entries of the KV cache."""

    @property
    def edl(self) -> float:
        """Effective decoding length: new tokens per forward pass after prefill."""
        return self.new_tokens / self.steps if self.steps else float(self.new_tokens)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.draft_s + self.forward_s + self.verify_s + self.compact_s


@dataclass
class GenerationOutput:
    token_ids: list[int]
    """New tokens only, end-of-sequence included if generated."""
    text: str
    """Decoded new text, ending before a stop string if one was hit."""
    stats: GenerationStats
    finish_reason: FinishReason
    """'stop': end-of-sequence, a stop token or a stop string; 'length': max_new_tokens reached."""
    logprobs: list[TokenLogprob] | None = None
    """Per new token, its log-probability and the likeliest alternatives (when asked for: `logprobs=k`)."""
    sources: list[int] = field(default_factory=list)
    """Per new token, the source flags of the draft node it was accepted from (drafting/ngrams.py); 0: the model's
    own token at the end of a step (drafting.ngrams.source_name names them)."""


class Generation:
    """The state of one sequence between steps."""

    def __init__(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        transcript: Transcript,
        chooser: TokenChooser | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.prompt = list(prompt)
        self.tokens = list(prompt)
        """Prompt and kept tokens; the last one is the next step's root, not yet in the cache."""
        self.max_new_tokens = max_new_tokens
        self.transcript = transcript
        self.chooser = chooser
        """How the model's token is chosen at a node (the model verifier's; replay reads a recording)."""
        self.on_tokens = on_tokens
        self.drafter: Drafter | None = None
        """Set while decoding with drafts; None for plain decoding."""
        self.prefilled = 0
        """Prompt tokens read into the cache so far (a long prompt is read in chunks, between steps)."""
        self.stats = GenerationStats()
        self.sources: list[int] = []
        """Per kept token, its draft node's source flags (0: the model's own token)."""

    @property
    def done(self) -> bool:
        return self.transcript.done

    @property
    def room(self) -> int:
        """Tokens this generation may still emit."""
        return self.max_new_tokens - self.stats.new_tokens

    def take(self, emitted: Sequence[int], sources: Sequence[int] = ()) -> list[int]:
        """Keep one step's tokens up to the first that ends the generation; the drafter learns them.

        `sources`: the source flags of the accepted draft tokens, in order (the rest are the model's own).
        """
        kept = self.transcript.extend(emitted)
        self.sources.extend([*sources[: len(kept)], *[0] * (len(kept) - len(sources))])
        self.tokens.extend(kept)
        self.stats.new_tokens += len(kept)
        if self.drafter is not None:
            self.drafter.learn(kept)
        if self.on_tokens is not None:
            self.on_tokens(kept)
        return kept

    def output(self) -> GenerationOutput:
        transcript = self.transcript
        chooser = self.chooser
        logprobs = None if chooser is None or chooser.logprobs is None else chooser.chosen[: len(transcript.tokens)]
        return GenerationOutput(
            list(transcript.tokens), transcript.text, self.stats, transcript.finish_reason or "length", logprobs,
            list(self.sources),
        )  # fmt: skip
