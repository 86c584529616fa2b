"""Answer sharing between replicas: every replica's trie learns from every replica's traffic.

Nothing here imports torch, transformers or Ray: the hub is a plain class that a Ray actor
wraps (server/replicas.py), the replay benchmark drives directly, and the tests check alone.

- hub.py   AnswerHub: the bounded, exactly-once log of finished answers, members and metrics
- sync.py  TrieSync: one replica's background rounds of publishing and learning
"""

from .hub import AnswerHub, Delivery, TokenizerMismatch
from .sync import TrieSync

__all__ = ["AnswerHub", "Delivery", "TokenizerMismatch", "TrieSync"]
