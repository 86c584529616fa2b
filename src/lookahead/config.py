"""Settings of the drafter: how large a draft tree may be and how it is matched."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, fields

DEFAULT_TRIE_MAX_NODES = 1_000_000
"""About 200 MB: `python -m lookahead.bench.triebench` measures under 200 bytes a node."""
DEFAULT_TRIE_HALF_LIFE = 200_000.0
"""Tokens after which an old sighting of an n-gram counts half as much as a new one (budget / 5)."""


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

    def __post_init__(self) -> None:
        for name in ("decoding_length", "branch_length", "match_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LookaheadConfig.{name} must be a positive integer, got {value!r}")
        if self.policy not in ("adaptive", "fixed"):
            raise ValueError(f"LookaheadConfig.policy must be 'adaptive' or 'fixed', got {self.policy!r}")
        if self.trie_max_nodes is not None and (not isinstance(self.trie_max_nodes, int) or self.trie_max_nodes < 1):
            raise ValueError(f"LookaheadConfig.trie_max_nodes must be positive or None, got {self.trie_max_nodes!r}")
        half_life = self.trie_half_life
        if half_life is not None and not (_is_number(half_life) and half_life > 0):
            raise ValueError(f"LookaheadConfig.trie_half_life must be positive or None, got {half_life!r}")
        if not (_is_number(self.min_score) and 0.0 <= self.min_score < 1.0):
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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _convert(key: str, text: str, kind: object) -> object:
    """`text` as a value of the type `kind` (int, float, str, or one of them or None)."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    optional = type(None) in options
    (base,) = [option for option in options if option is not type(None)]
    if optional and text.lower() == "none":
        return None
    try:
        return base(text)
    except ValueError:
        names = {int: "an integer", float: "a number", str: "text"}
        rule = names[base] + (" or none" if optional else "")
        raise ValueError(f"{key} must be {rule}, got {text!r}") from None
