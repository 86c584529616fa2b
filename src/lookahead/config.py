"""Settings of the drafter: how large a draft tree may be and how it is matched."""

from __future__ import annotations

from dataclasses import dataclass

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
        if self.trie_half_life is not None and not self.trie_half_life > 0:
            raise ValueError(f"LookaheadConfig.trie_half_life must be positive or None, got {self.trie_half_life!r}")
        if not 0.0 <= self.min_score < 1.0:
            raise ValueError(f"LookaheadConfig.min_score must be in [0, 1), got {self.min_score!r}")

    @property
    def ngram_length(self) -> int:
        """Longest n-gram the trie stores: a matched tail plus a full branch."""
        return self.match_length + self.branch_length
