"""The seam between the engine and a model's runtime (transformers, llama.cpp): what the engine asks of either.

A backend owns everything that depends on how the model runs: its verifier (decoding/step.py:
Verifier), which drafts it verifies exactly, its limits, and the price of its steps. The
engine, the step loop and the drafter are the same for every backend; the engine picks the
backend by the model's `runtime` (lookahead/engine.py: backend_for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from .costs import Meter
    from .step import Verifier

DraftMode = Literal["tree", "chain", "off"]
"""What a model verifies exactly: branching drafts, single paths, or no drafts at all."""


class Backend(Protocol):
    """One model on one runtime, as the engine uses it."""

    name: str
    """The runtime, as users name it ('transformers', 'llama.cpp')."""
    vocab_size: int
    max_positions: int | None
    """Most tokens a request may hold (prompt and output); None: no limit known."""
    eos_ids: frozenset[int]
    """Tokens a generation ends at, as this runtime's own plain decoding ends."""
    draft_mode: DraftMode
    max_draft: int
    """Most draft nodes one pass verifies: LookaheadConfig.decoding_length, or fewer where wider passes would not
    give plain decoding's tokens."""
    verifier: Verifier

    def enable_batching(self, max_batch: int) -> bool:
        """Verify the rows of a batch (up to `max_batch` at once) together from now on, where the runtime can; True if
        each row then pays only for its own tokens (packed), False if for the widest row's (padded) or if rows are
        verified one at a time. May change `max_positions` and `draft_mode`."""
        ...

    def meter(self, batched: bool = False) -> Meter:
        """What times this runtime's passes for its cost curves: of one row, or (`batched`) of rows as they batch."""
        ...
