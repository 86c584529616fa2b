"""Settings: the drafter's (how large a draft tree may be and how it is matched), and the cache directory."""

from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

DEFAULT_TRIE_MAX_NODES = 1_000_000
"""About 200 MB: `python -m lookahead.bench.triebench` measures under 200 bytes a node."""
DEFAULT_TRIE_HALF_LIFE = 200_000.0
"""Tokens after which an old sighting of an n-gram counts half as much as a new one (budget / 5)."""
SEED_LIMIT = 2**64
"""Seeds are torch generator seeds, unsigned 64-bit: any integer in [-SEED_LIMIT // 2, SEED_LIMIT) is accepted, a
negative one taken modulo SEED_LIMIT (its two's complement), so every int64 and uint64 is a seed."""
LINEARS = ("auto", "packed", "model")
"""How a transformers model's linear layers run on a CPU (LookaheadConfig.linears)."""
MAX_RECYCLED = 64
"""Most next tokens per token a config or a trie file may keep for recycled drafts (152k tokens x 64: 39 MB)."""
MAX_NGRAM_LENGTH = 256
"""Longest n-gram a trie may store. A prompt of n tokens adds up to n times this many nodes,
so a config or a trie file must not ask for a million; the default is 36 (match 4 + branch 32)."""


@dataclass(frozen=True)
class LookaheadConfig:
    """Upper bounds and matching rules for the draft tree of each decoding step.

    With the adaptive policy these are only limits: each step sends the part of the tree
    worth its measured cost, often a few nodes on a CPU. They are wide enough for long copies
    (text quoted from a document goes 32 tokens deep), which the drafter sweep on the
    benchmark sets shows is where the largest gains are; 16 deep lost up to 16 % there.
    """

    decoding_length: int = 32
    """Most draft nodes verified in one forward pass (the root not counted)."""
    branch_length: int = 32
    """Deepest draft path: most tokens a step can accept before its bonus token."""
    match_length: int = 4
    """Longest context tail looked up in the trie; shorter tails are tried when it misses."""
    min_score: float = 0.0
    """Draft nodes whose estimated acceptance probability is below this are not sent."""
    policy: str = "adaptive"
    """'adaptive': send the part of the tree worth its measured cost; 'fixed': send all of it."""
    trie_max_nodes: int | None = DEFAULT_TRIE_MAX_NODES
    """Most nodes the shared trie keeps (None: no limit); the least useful are evicted past it."""
    trie_half_life: float | None = DEFAULT_TRIE_HALF_LIFE
    """Decay of the counts that decide eviction, in tokens learned (None: plain counts)."""
    recycled: int = 0
    """Recycled drafts: for every token, keep the model's `recycled` likeliest next tokens from the last pass that
    computed them, and draft from them too (drafting/recycled.py; 8 is Token Recycling's). 0, the default: none —
    on the CPUs measured they add tokens per step but no tokens per second (benchmarks/NOTES.md)."""
    linears: str = "auto"
    """A float32 (or, where the CPU computes it, bfloat16) transformers model on a CPU: 'auto' runs its linear layers
    through faster kernels than the model's (float32: the row kernel built for this CPU, backends/transformers/
    rowkernel.py, unless LOOKAHEAD_ROW_KERNEL=off; else weights packed once for oneDNN, which double the memory the
    linear weights take) in the passes wide enough for that to measure faster on this machine (cached), the model's
    own in narrower ones; 'packed' always, 'model' never."""
    direct_layers: bool = True
    """A Llama-shaped transformers model (Llama, Qwen2, Mistral, SmolLM2): run its layers as one loop, without
    transformers' per-layer plumbing, where a check at start finds it gives the model's logits bit for bit
    (backends/transformers/decoder.py); False: always through the model's forward."""

    def __post_init__(self) -> None:
        for name in ("decoding_length", "branch_length", "match_length"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"LookaheadConfig.{name} must be a positive integer, got {value!r}")
        if self.policy not in ("adaptive", "fixed"):
            raise ValueError(f"LookaheadConfig.policy must be 'adaptive' or 'fixed', got {self.policy!r}")
        check_ngram_length(self.ngram_length, "LookaheadConfig.match_length + branch_length (the n-gram length)")
        check_max_nodes(self.trie_max_nodes, "LookaheadConfig.trie_max_nodes")
        check_half_life(self.trie_half_life, "LookaheadConfig.trie_half_life")
        check_recycled(self.recycled, "LookaheadConfig.recycled")
        if not isinstance(self.direct_layers, bool):
            raise ValueError(f"LookaheadConfig.direct_layers must be true or false, got {self.direct_layers!r}")
        if self.linears not in LINEARS:
            raise ValueError(f"LookaheadConfig.linears must be one of {', '.join(LINEARS)}, got {self.linears!r}")
        if not (is_finite_number(self.min_score) and 0.0 <= self.min_score < 1.0):
            raise ValueError(f"LookaheadConfig.min_score must be in [0, 1), got {self.min_score!r}")

    @classmethod
    def parse(cls, settings: str) -> LookaheadConfig:
        """A config from `key=value,key=value` (command-line text), each value read as its field's type.

        `none` sets an optional field to None. ValueError, naming the key, for anything else.
        """
        types_of = typing.get_type_hints(cls)
        known = {f.name for f in fields(cls)}
        overrides: dict[str, object] = {}
        for item in settings.split(","):
            key, equals, value = (part.strip() for part in item.partition("="))
            if key not in known:
                raise ValueError(f"unknown setting {key!r}: choose from {', '.join(sorted(known))}")
            if not equals:
                raise ValueError(f"setting {key!r} has no value: write {key}=VALUE")
            overrides[key] = _convert(key, value, types_of[key])
        return cls(**overrides)

    @property
    def ngram_length(self) -> int:
        """Longest n-gram the trie stores: a matched tail plus a full branch."""
        return self.match_length + self.branch_length


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool, which is an int in Python) that is neither nan nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: object) -> bool:
    """An int that is not a bool: settings read from JSON must not take `true` for 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_ngram_length(value: object, name: str = "ngram_length") -> None:
    """ValueError unless `value` is an int in [2, MAX_NGRAM_LENGTH]; shared by configs, tries and trie files."""
    if not (is_int(value) and 2 <= value <= MAX_NGRAM_LENGTH):
        raise ValueError(f"{name} must be an integer from 2 to {MAX_NGRAM_LENGTH}, got {value!r}")


def check_recycled(value: object, name: str = "recycled") -> None:
    """ValueError unless `value` is an int in [0, MAX_RECYCLED] (0: no recycled drafts)."""
    if not (is_int(value) and 0 <= value <= MAX_RECYCLED):
        raise ValueError(f"{name} must be an integer from 0 to {MAX_RECYCLED}, got {value!r}")


def check_max_nodes(value: object, name: str = "max_nodes") -> None:
    """ValueError unless `value` is a positive int or None (no budget)."""
    if value is not None and not (is_int(value) and value >= 1):
        raise ValueError(f"{name} must be positive or None, got {value!r}")


def check_half_life(value: object, name: str = "half_life") -> None:
    """ValueError unless `value` is a finite positive number or None (plain counts)."""
    if value is not None and not (is_finite_number(value) and value > 0):
        raise ValueError(f"{name} must be positive or None, got {value!r}")


_BOOLEANS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _convert(key: str, text: str, kind: object) -> object:
    """`text` as a value of the type `kind` (bool, int, float, str, or one of them or None)."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    optional = type(None) in options
    (base,) = [option for option in options if option is not type(None)]
    if optional and text.lower() == "none":
        return None
    if base is bool:
        if text.lower() not in _BOOLEANS:
            raise ValueError(f"{key} must be true or false, got {text!r}")
        return _BOOLEANS[text.lower()]
    try:
        return base(text)
    except ValueError:
        names = {int: "an integer", float: "a number", str: "text"}
        rule = names[base] + (" or none" if optional else "")
        raise ValueError(f"{key} must be {rule}, got {text!r}") from None


def cache_dir() -> Path:
    """Where converted models, and cost curves and other measurements of this machine, are kept: $LOOKAHEAD_CACHE,
    else $XDG_CACHE_HOME/lookahead, else ~/.cache/lookahead."""
    if explicit := os.environ.get("LOOKAHEAD_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lookahead"
