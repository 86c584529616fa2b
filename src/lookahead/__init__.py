"""Lookahead: lossless multi-branch speculative decoding from a token trie, for transformers models."""

from .config import LookaheadConfig
from .draft import DraftTree
from .engine import GenerationOutput, GenerationStats, LookaheadEngine
from .models import load_model
from .trie import TokenTrie

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
