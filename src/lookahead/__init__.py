"""Lookahead: lossless multi-branch speculative decoding from a token trie, for transformers models.

The package is laid out the way data flows: `drafting` (torch-free: the trie, draft trees,
the cost-aware policy) proposes, `decoding` (the only code that calls the model) verifies,
and the clients — `cli`, `server`, `bench`, `hf` — sit on top. Names are imported on first
use, so `import lookahead` (or the drafting core alone) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "DraftTree": "lookahead.drafting.tree",
    "GenerationOutput": "lookahead.decoding.generation",
    "GenerationStats": "lookahead.decoding.generation",
    "LookaheadConfig": "lookahead.config",
    "LookaheadEngine": "lookahead.engine",
    "TokenTrie": "lookahead.drafting.trie",
    "load_model": "lookahead.models",
}

__all__ = [
    "DraftTree",
    "GenerationOutput",
    "GenerationStats",
    "LookaheadConfig",
    "LookaheadEngine",
    "TokenTrie",
    "load_model",
]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import LookaheadConfig
    from .decoding.generation import GenerationOutput, GenerationStats
    from .drafting.tree import DraftTree
    from .drafting.trie import TokenTrie
    from .engine import LookaheadEngine
    from .models import load_model


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'lookahead' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
