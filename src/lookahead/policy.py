"""What each step drafts: one request's view of the trie, and the size of its draft tree.

The policy today is fixed: the trie's best-first tree up to `decoding_length` nodes and
`branch_length` deep. It lives here, apart from the engine, so that the real engine and the
offline replay draft in exactly the same way, and so that a cost-aware policy can replace it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import LookaheadConfig
from .draft import DraftTree
from .trie import TokenTrie


class DraftSession:
    """One request's drafting: its prompt n-grams in, its outputs learned, all released at close."""

    def __init__(self, trie: TokenTrie, config: LookaheadConfig, prompt: Sequence[int]) -> None:
        self.trie = trie
        self.config = config
        self.request = object()
        trie.insert(prompt, request=self.request)

    def propose(self, sequence: Sequence[int], remaining: int, branching: bool) -> DraftTree:
        """Draft for the step whose root is `sequence[-1]`, with `remaining` tokens still allowed."""
        config = self.config
        return self.trie.retrieve(
            sequence,
            config.decoding_length,
            min(config.branch_length, remaining - 1),  # the bonus token takes the last place
            request=self.request,
            match_length=config.match_length,
            branching=branching,
            min_score=config.min_score,
        )

    def learn(self, tokens: Sequence[int]) -> None:
        self.trie.observe(self.request, tokens)

    def close(self) -> None:
        self.trie.finish(self.request)
