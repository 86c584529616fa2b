"""What each step drafts: one request's view of the trie, and how many nodes the step is worth.

A draft node costs compute whether or not it is accepted. On a GPU a forward pass over 64
tokens costs about one plain step; on a CPU it costs three or four. So the adaptive policy
prices every step: from the trie's best-first tree it sends the prefix that maximises
expected emitted tokens per predicted millisecond, which may be no draft at all.

- Cost: milliseconds of a forward pass by its width, measured on the model at start and
  scaled online by how real steps compare with the prediction.
- Acceptance: the trie's path score (product of count ratios along the path), calibrated
  online: per score bin, the share of sent nodes that verification actually accepted.

The engine and the offline replay both draft through DraftSession, so a replay predicts the
real run exactly.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from .config import LookaheadConfig
from .draft import DraftTree
from .trie import TokenTrie


class CostModel:
    """Forward-pass milliseconds by width (root + draft nodes), from measured points.

    Widths below SMOOTH_FROM are kept as measured: on CPUs, 2 or 3 tokens can cost more than
    8 (the matrix kernels change), and the policy must know. From SMOOTH_FROM up the cost is
    close to a straight line and the measurement noise is larger than its curvature, so those
    points are replaced by a least-squares line through them.
    """

    SMOOTH_FROM = 4

    def __init__(self, points: Mapping[int | str, float]) -> None:
        ordered = sorted((int(w), float(ms)) for w, ms in points.items())
        if len(ordered) < 2 or any(ms <= 0 for _, ms in ordered):
            raise ValueError("a cost model needs at least two widths with positive times")
        self.widths = [w for w, _ in ordered]
        self.base = [ms for _, ms in ordered]
        wide = [i for i, w in enumerate(self.widths) if w >= self.SMOOTH_FROM]
        if len(wide) >= 3:
            slope, intercept = np.polyfit([self.widths[i] for i in wide], [self.base[i] for i in wide], 1)
            for i in wide:
                self.base[i] = max(float(intercept + slope * self.widths[i]), 1e-3)
        self.scale = 1.0

    def predict(self, width: int) -> float:
        widths, base = self.widths, self.base
        i = min(max(bisect.bisect_left(widths, width), 1), len(widths) - 1)
        w0, w1, c0, c1 = widths[i - 1], widths[i], base[i - 1], base[i]
        return self.scale * max(c0 + (c1 - c0) * (width - w0) / (w1 - w0), base[0] * 0.5)

    def observe(self, width: int, milliseconds: float) -> None:
        """Follow drift (load, longer context) with one slowly moving factor; ignore outliers."""
        surprise = milliseconds / self.predict(width)
        if 0.2 < surprise < 5:
            self.scale = 0.95 * self.scale + 0.05 * self.scale * surprise


class Calibration:
    """Observed acceptance rate of sent draft nodes, by bin of their trie score."""

    BINS = 10

    def __init__(self) -> None:
        # a weak prior that the trie's score is right, so early steps trust it
        self.sent = [2.0] * self.BINS
        self.accepted = [2.0 * (b + 0.5) / self.BINS for b in range(self.BINS)]
        self._lock = threading.Lock()

    def _bin(self, score: float) -> int:
        return min(int(score * self.BINS), self.BINS - 1)

    def probability(self, score: float) -> float:
        b = self._bin(score)
        return self.accepted[b] / self.sent[b]

    def update(self, scores: Sequence[float], accepted: Sequence[int]) -> None:
        """`accepted`: block indices (1-based draft positions) verification kept."""
        kept = set(accepted)
        with self._lock:
            for index, score in enumerate(scores, start=1):
                b = self._bin(score)
                self.sent[b] += 1
                self.accepted[b] += index in kept


def best_prefix(probabilities: Sequence[float], cost: CostModel) -> int:
    """Number of leading nodes maximising (1 + expected accepted) / predicted cost; 0 = no draft."""
    best, best_rate, expected = 0, 1.0 / cost.predict(1), 1.0
    for k, p in enumerate(probabilities, start=1):
        expected += p
        rate = expected / cost.predict(k + 1)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class DraftPolicy:
    """Engine-wide drafting state: the cost model and the calibration, shared by all requests.

    With no cost model the policy is fixed: the whole retrieved tree is sent, as the
    original Lookahead does.
    """

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost
        self.calibration = Calibration()

    @property
    def adaptive(self) -> bool:
        return self.cost is not None

    def size(self, tree: DraftTree) -> int:
        if self.cost is None or not len(tree):
            return len(tree)
        return best_prefix([self.calibration.probability(s) for s in tree.scores], self.cost)

    def feedback(self, tree: DraftTree, accepted: Sequence[int], milliseconds: float | None) -> None:
        if self.cost is None:
            return
        self.calibration.update(tree.scores, accepted)
        if milliseconds is not None:
            self.cost.observe(len(tree) + 1, milliseconds)


class DraftSession:
    """One request's drafting: its prompt n-grams in, its outputs learned, all released at close."""

    def __init__(
        self, trie: TokenTrie, config: LookaheadConfig, prompt: Sequence[int], policy: DraftPolicy | None = None
    ) -> None:
        self.trie = trie
        self.config = config
        self.policy = policy or DraftPolicy()
        self.request = object()
        trie.insert(prompt, request=self.request)

    def propose(self, sequence: Sequence[int], remaining: int, branching: bool) -> DraftTree:
        """Draft for the step whose root is `sequence[-1]`, with `remaining` tokens still allowed."""
        config = self.config
        tree = self.trie.retrieve(
            sequence,
            config.decoding_length,
            min(config.branch_length, remaining - 1),  # the bonus token takes the last place
            request=self.request,
            match_length=config.match_length,
            branching=branching,
            min_score=config.min_score,
        )
        size = self.policy.size(tree)
        return tree if size == len(tree) else tree.truncated(size)

    def verified(self, tree: DraftTree, accepted: Sequence[int], milliseconds: float | None = None) -> None:
        """What verification made of the draft: feeds the policy's calibration and cost model."""
        self.policy.feedback(tree, accepted, milliseconds)

    def learn(self, tokens: Sequence[int]) -> None:
        self.trie.observe(self.request, tokens)

    def close(self) -> None:
        self.trie.finish(self.request)
