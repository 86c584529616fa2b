"""How many draft nodes a step is worth, and which: the cost model and the learned acceptance.

A draft node costs compute whether or not it is accepted. On a GPU a forward pass over 64
tokens costs about one plain step; on a CPU it costs three or four. So the adaptive policy
prices every step: the trie drafts best-first by each node's learned chance of acceptance,
and the policy sends the likeliest nodes, as many as maximise expected emitted tokens per
predicted millisecond, which may be no draft at all.

- Cost: milliseconds of a forward pass by its width, rows and context length, measured on
  the model at start and corrected online by how real steps of that size compare with the
  prediction.
- Acceptance: per node, the chance it is accepted once its parent is, learned online from
  verification by where the node's n-gram was seen and the trie's count ratio (Calibration),
  engine-wide and per request, with one level over all requests that keeps the rates at what is
  accepted; a node's chance is the product along its path, discounted by depth where sent paths
  ran hopeful (deeper nodes are grown from the likeliest-looking ones), for all requests and for each.

The engine and the offline replay both draft through the same trie drafter (drafter.py) and
the same step, so a replay predicts the real run exactly.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from .ngrams import FOLLOWED, OUTPUT, OVERRULED, PROMPT, RECYCLED
from .recycled import rank_of
from .tree import DraftTree


def _curve(points: Mapping[int | str, float]) -> tuple[list[int], list[float]]:
    """Measured (width, ms) points as ascending widths and smoothed times (see CostModel)."""
    ordered = sorted((int(w), float(ms)) for w, ms in points.items())
    if len(ordered) < 2 or any(ms <= 0 for _, ms in ordered):
        raise ValueError("a cost model needs at least two widths with positive times")
    widths = [w for w, _ in ordered]
    base = [ms for _, ms in ordered]
    wide = [i for i, w in enumerate(widths) if w >= CostModel.SMOOTH_FROM]
    if len(wide) >= 3:
        slope, intercept = np.polyfit([widths[i] for i in wide], [base[i] for i in wide], 1)
        for i in wide:
            base[i] = max(float(intercept + slope * widths[i]), 1e-3)
    return widths, base


FAR = 1e7
"""Where a curve's end segments are carried to, so that interpolation extrapolates them (no pass is that wide)."""


class _Line(NamedTuple):
    """A smoothed curve: its points, and the same points with the end segments carried out to ±FAR, which
    `np.interp` (one C call: a step prices many widths, many times) evaluates as the curve."""

    widths: list[int]
    base: list[float]
    xs: np.ndarray
    ys: np.ndarray

    @classmethod
    def of(cls, widths: list[int], base: list[float]) -> _Line:
        def carried(i: int, j: int, x: float) -> float:  # the line through points i and j, at x
            return base[i] + (base[j] - base[i]) * (x - widths[i]) / (widths[j] - widths[i])

        xs = np.array([-FAR, *widths, FAR], dtype=np.float64)
        ys = np.array([carried(0, 1, -FAR), *base, carried(-2, -1, FAR)], dtype=np.float64)
        return cls(widths, base, xs, ys)

    def at(self, width: np.ndarray) -> np.ndarray:
        """The curve at each of `width`, linear between points and beyond the ends (never below half the narrowest)."""
        return np.maximum(np.interp(width, self.xs, self.ys), self.base[0] * 0.5)


BASE_CONTEXT = 128
"""Cached tokens behind the measured width curves; what curves at other contexts add is added to them."""


class CostModel:
    """Forward-pass milliseconds by width (root + draft nodes), rows (sequences verified together) and context.

    Widths below SMOOTH_FROM are kept as measured: on CPUs, 2 or 3 tokens can cost more than
    8 (the matrix kernels change), and the policy must know. From SMOOTH_FROM up the cost is
    close to a straight line and the measurement noise is larger than its curvature, so those
    points are replaced by a least-squares line through them. `batched` adds a curve per
    measured row count; other row counts are interpolated between them (and extrapolated
    past the largest from the last two). `contexts` adds one-row curves measured after more
    cached tokens than BASE_CONTEXT: a step of r rows after c tokens costs the base curve plus
    r times what the one-row curve adds at c (linear in c between measured lengths and past
    the longest, since attention reads every cached token), as every row attends its own
    cache (a packed step's to the longest row's length): what the context adds grows with the
    rows, where the rest of a step, the weights read once, does not (benchmarks/NOTES.md). A
    longer context never adds less than nothing: two measurements' noise, times the rows, must
    not make a step cheaper than after fewer tokens.

    Real steps correct the measurement: each size of step — its row count and width bucket
    (1, 2, 3-4, 5-8, …) — learns its own factor (observed / measured). A start-up
    measurement on a shared CPU can be off by 2x at one size and right at the next (8 rows
    of 4 tokens measured at 1.2x 8 rows of 1, then running at 2.1x); one factor for all
    sizes cannot undo a wrong shape. A size without recent evidence takes what its width
    bucket has shown at any row count (a closed batch's rows leave one by one, so most row
    counts of its tail are new, and its drafting steps ran dearer than measured at every row
    count, benchmarks/NOTES.md), and where the bucket has no evidence `scale`, the factor of
    plain steps (width 1, which every policy can fall back to, so they are seen whenever
    drafting is priced too high). An underpriced drafting size is chosen, observed
    and repriced; an overpriced one loses its evidence as it ages and is tried again, at no
    less than a narrower size's factor (`_bucket_factors`).
    """

    SMOOTH_FROM = 4
    LEARNING_RATE = 0.1
    """Weight of a new step in its size's factor once it has 1 / LEARNING_RATE steps (before: their mean)."""
    PRIOR_STEPS = 2.0
    """Steps of evidence `scale` is worth against a size's own factor."""
    FORGET = 0.99
    """A size's evidence fades by this much for every step of another size."""

    def __init__(
        self,
        points: Mapping[int | str, float],
        batched: Mapping[int | str, Mapping[int | str, float]] | None = None,
        contexts: Mapping[int | str, Mapping[int | str, float]] | None = None,
    ) -> None:
        self.widths, self.base = _curve(points)
        """The curve of one row."""
        curves = {1: (self.widths, self.base)}
        curves.update({int(rows): _curve(curve) for rows, curve in (batched or {}).items()})
        self._curves = {rows: _Line.of(w, ms) for rows, (w, ms) in curves.items()}
        self._rows = sorted(self._curves)
        longer = {int(length): _curve(curve) for length, curve in (contexts or {}).items()}
        self._contexts = [
            (length, _Line.of(w, ms))
            for length, (w, ms) in sorted({**longer, BASE_CONTEXT: (self.widths, self.base)}.items())
        ]
        self.scale = 1.0
        """Observed / measured cost of plain steps, followed slowly: the machine's load and context."""
        self._factors: dict[tuple[int, int], tuple[float, float, int]] = {}
        """(rows, width bucket) -> (observed / measured, steps of evidence, step count when last seen)."""
        self._bucket_evidence: dict[int, tuple[float, float, int]] = {}
        """Width bucket -> the same over steps of any row count: the prior of a row count not seen at it."""
        self._steps = 0

    def measurement(self) -> CostModel:
        """A cost model of the same measured curves, without what this one learned from real steps."""
        points = {rows: dict(zip(line.widths, line.base, strict=True)) for rows, line in self._curves.items()}
        longer = {
            length: dict(zip(line.widths, line.base, strict=True))
            for length, line in self._contexts
            if length != BASE_CONTEXT
        }
        return CostModel(points[1], {rows: curve for rows, curve in points.items() if rows != 1}, longer)

    @property
    def rows(self) -> list[int]:
        """The row counts measured."""
        return list(self._rows)

    @property
    def contexts(self) -> list[int]:
        """The context lengths measured (BASE_CONTEXT among them)."""
        return [length for length, _ in self._contexts]

    def measured(self, width: float, rows: int = 1, context: int = BASE_CONTEXT) -> float:
        """The start-up measurement at this size, interpolated: no online correction."""
        return float(self._measured(np.array([width]), rows, context)[0])

    def _measured(self, width: np.ndarray, rows: int, context: int) -> np.ndarray:
        one_row = self._curves[1].at(width)
        at_base = one_row if rows == 1 or len(self._rows) == 1 else self._rows_at(width, rows)
        if len(self._contexts) == 1 or context == BASE_CONTEXT:
            return at_base
        extra = self._longer(width, context, one_row) - one_row
        if context > BASE_CONTEXT:
            extra = np.maximum(extra, 0.0)
        return np.maximum(at_base + rows * extra, at_base * 0.5)

    def _rows_at(self, width: np.ndarray, rows: int) -> np.ndarray:
        known = self._rows
        i = min(max(bisect.bisect_left(known, rows), 1), len(known) - 1)
        r0, r1 = known[i - 1], known[i]
        c0, c1 = (self._curves[r].at(width) for r in (r0, r1))
        return np.maximum(c0 + (c1 - c0) * (rows - r0) / (r1 - r0), c0)  # more rows never cost less

    def _longer(self, width: np.ndarray, context: int, one_row: np.ndarray) -> np.ndarray:
        """One row of `width` after `context` cached tokens: linear between measured lengths, at least half the base."""
        lengths = self.contexts
        i = min(max(bisect.bisect_left(lengths, context), 1), len(lengths) - 1)
        (l0, curve0), (l1, curve1) = self._contexts[i - 1], self._contexts[i]
        c0, c1 = curve0.at(width), curve1.at(width)
        return np.maximum(c0 + (c1 - c0) * (context - l0) / (l1 - l0), one_row * 0.5)

    def _bucket_factors(self, rows: int, widest: int) -> list[float]:
        """For each width bucket up to `widest`, how real steps of that size compare with the measurement: its own
        recent evidence blended with a prior.

        The prior is the bucket's factor over every row count (`scale` where the bucket has no
        evidence), or a narrower size's factor of the same rows where that is higher: a curve
        that underprices narrow blocks underprices wider ones at least as much
        (benchmarks/NOTES.md), so a wide size seldom tried is not taken for cheaper than its
        neighbours. And no size's factor is below a narrower one's: a factor falling from one
        bucket to the next makes the price fall where the bucket begins, a wider step priced
        under a narrower one, which tells a packed step that any node may be worth sending to
        get there (`least_gain` 0: every row of a batch retrieved its whole budget, benchmarks/NOTES.md).
        """
        factors, narrower = [], 0.0
        for bucket in range(widest + 1):
            prior = self._bucket_prior(bucket)
            own = self._blended(rows, bucket, max(prior, narrower))
            factors.append(max(own, factors[-1]) if factors else own)
            narrower = max(narrower, self._blended(rows, bucket, prior))
        return factors

    def _bucket_prior(self, bucket: int) -> float:
        """What steps of this width bucket ran at over every row count, blended with `scale`."""
        return self._faded(self._bucket_evidence.get(bucket), self.scale)

    def _blended(self, rows: int, bucket: int, prior: float) -> float:
        return self._faded(self._factors.get((rows, bucket)), prior)

    def _faded(self, learned: tuple[float, float, int] | None, prior: float) -> float:
        """A learned factor, its evidence faded by the steps since, blended with `prior` (PRIOR_STEPS of evidence)."""
        if learned is None:
            return prior
        factor, evidence, seen = learned
        evidence *= self.FORGET ** (self._steps - seen)
        return (evidence * factor + self.PRIOR_STEPS * prior) / (evidence + self.PRIOR_STEPS)

    def _learned(self, learned: tuple[float, float, int] | None, ratio: float) -> tuple[float, float, int]:
        """A factor after one more step that ran at `ratio` of its measured price."""
        factor, evidence, seen = learned if learned is not None else (ratio, 0.0, self._steps)
        evidence = evidence * self.FORGET ** (self._steps - seen) + 1
        return factor + (ratio - factor) * max(1 / evidence, self.LEARNING_RATE), evidence, self._steps

    def predict(self, width: float, rows: int = 1, context: int = BASE_CONTEXT) -> float:
        return float(self.predict_widths([width], rows, context)[0])

    def predict_widths(self, widths: Sequence[float], rows: int = 1, context: int = BASE_CONTEXT) -> np.ndarray:
        """`predict` at many widths at once: a step prices every width it could send in one go."""
        width = np.asarray(widths, dtype=np.float64)
        buckets = _buckets(width)
        factors = np.array(self._bucket_factors(rows, int(buckets.max(initial=0))))
        return self._measured(width, rows, context) * factors[buckets]

    def overpriced(self, below: float, evidence: float) -> str | None:
        """A size whose recent steps ran under `below` times its measured price, with at least `evidence` steps
        behind the factor (in words), or None. Other load only slows a pass, so such a curve was measured while
        something else ran: it is wrong, not the machine busy now."""
        for (rows, bucket), (factor, seen_steps, seen) in sorted(self._factors.items()):
            if factor < below and seen_steps * self.FORGET ** (self._steps - seen) >= evidence:
                low, high = (1, 1) if bucket == 0 else (2 ** (bucket - 1) + 1, 2**bucket)
                tokens = str(low) if low == high else f"{low}-{high}"
                return f"steps of {rows} row(s) x {tokens} token(s) ran at {factor:.2f}x their measured price"
        return None

    def observe(self, width: float, milliseconds: float, rows: int = 1, context: int = BASE_CONTEXT) -> None:
        """Learn from a real step of this size; a step 5x off what its size has been running at is an outlier (a
        pause), ignored."""
        ratio = milliseconds / self.measured(width, rows, context)
        bucket = _bucket(width)
        key = (rows, bucket)
        if not 0.2 < ratio / self._blended(rows, bucket, self._bucket_prior(bucket)) < 5:  # not a narrower one's floor
            return
        if width == 1:
            self.scale += 0.05 * (ratio - self.scale)
        self._factors[key] = self._learned(self._factors.get(key), ratio)
        self._bucket_evidence[bucket] = self._learned(self._bucket_evidence.get(bucket), ratio)
        self._steps += 1


class StepCost(Protocol):
    """What the policy prices steps by: a CostModel (measured curves), or vLLM's TokensCost (vllm/chains.py)."""

    def predict_widths(self, widths: Sequence[float], rows: int = 1, context: int = BASE_CONTEXT) -> np.ndarray:
        """Milliseconds of a step of `rows` rows carrying each of `widths` tokens a row (mean), after `context`."""
        ...

    def observe(self, width: float, milliseconds: float, rows: int = 1, context: int = BASE_CONTEXT) -> None:
        """A real step of this size took `milliseconds`."""
        ...


def _buckets(widths: np.ndarray) -> np.ndarray:
    """Widths 1, 2, 3-4, 5-8, 9-16, … (a packed step's mean width rounded up) → 0, 1, 2, 3, 4, …: neighbours cost
    alike. The bit length of ceil(width) - 1."""
    return np.frexp(np.ceil(widths) - 1)[1]


def _bucket(width: float) -> int:
    return int(_buckets(np.float64(width)))


OVERRULED_PRIOR = 0.6
"""A node the model last overruled starts at this share of its trie prior: on the recorded answers such nodes were
accepted well under their ratio bin's midpoint and the model's own choices about at it; the replays barely move
with this share (benchmarks/NOTES.md, "What the model chose last after the same token")."""


class Calibration:
    """How often a draft node is accepted once its parent is, learned from verification.

    Nodes fall in cells by where their n-gram was seen (the request's prompt, earlier
    output, a corpus; or nowhere, only recycled from the model's own top tokens), by the
    trie's estimate for that edge (child count / parent count, in RATIO_BINS bins; a recycled
    node's rank among the model's next tokens), by how many tokens of the context the tree's
    root matched (1 to MATCH_BINS), by whether they continue an accepted draft token (depth
    2 or more) or start a draft, by whether their n-gram was seen once or more, and by what
    the model's own output last put after their parent's token: this token, another one, or
    nothing known (FOLLOWED, OVERRULED). Replayed benchmark prompts show why all six
    (benchmarks/NOTES.md): in one ratio bin a continuation
    copied from the prompt is likelier accepted than one seen in earlier answers, and by how
    much varies from one data set to another (hence the per-request rates); a continuation of
    more matched tokens is likelier accepted; a node whose parent was accepted is in a run of
    copied text, far likelier accepted than the first node of a draft; and a ratio of 1 from a
    single sighting is weaker evidence than one from several; and a continuation the model
    itself chose after that token the last time is far likelier accepted than one it did not.

    A cell's rate is (accepted + weight * prior) / (sent + weight): the engine's calibration
    has the trie's own estimate as prior; a request's (RequestRates) has the engine's rates
    times the request's level, so a request that copies heavily from its document learns so
    within a few steps.
    """

    RATIO_BINS = 5
    SOURCES = 4
    """Prompt, earlier output, corpus, recycled only."""
    MATCH_BINS = 4
    """Matched tails of 1 to MATCH_BINS - 1 tokens, one bin each, and of MATCH_BINS or more (none: as one)."""
    SEEN_BINS = 2
    """An n-gram seen once; seen more often (or not from a trie)."""
    FOLLOW_BINS = 3
    """Nothing known of what the model put after the parent's token; this token (FOLLOWED); another (OVERRULED)."""
    CELLS = SOURCES * RATIO_BINS * MATCH_BINS * 2 * SEEN_BINS * FOLLOW_BINS
    HALVE_AT = 1000.0
    """Past this many observations a cell's counts are halved: the rate follows recent traffic."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.sent = np.zeros(self.CELLS)
        self.accepted = np.zeros(self.CELLS)
        self.observed = (np.zeros(self.CELLS), np.zeros(self.CELLS))
        """(sent, accepted) per cell of every observation made here, never halved: what replicas share."""
        self._lock = threading.Lock()

    @classmethod
    def trie_prior(cls) -> np.ndarray:
        """Rates that trust the trie: each ratio bin's midpoint, in every cell of a trie source.

        A recycled node's prior is half its Zipf share (1/2 for the model's first choice, 1/4
        for its second, …), trusting too: a lower prior (0.15 for the first choice) drafted
        less and gained less on the recorded answers, as the cells learn within a request.

        Trusting is what keeps an engine exploring: a doubted prior (half the midpoint where
        drafts start) matched a fresh engine's first request better, but on the recorded
        Qwen answers it kept the engine from ever trying the drafts that earlier answers
        offered (predicted speedup 1.65x -> 1.50x warm). A request that fails instead backs
        off within a few steps (RequestRates). Only a node the model last overruled starts
        doubted (OVERRULED_PRIOR): that is evidence, not a fresh engine's ignorance.
        """
        midpoints = (np.arange(cls.RATIO_BINS) + 0.5) / cls.RATIO_BINS
        ranks = np.arange(cls.RATIO_BINS)[::-1]  # bin RATIO_BINS - 1 is rank 0
        recycled = 0.5 / (ranks + 1)
        per_source = np.tile(midpoints, cls.SOURCES - 1)
        prior = np.repeat(np.concatenate([per_source, recycled]), cls.MATCH_BINS * 2 * cls.SEEN_BINS * cls.FOLLOW_BINS)
        prior[2 :: cls.FOLLOW_BINS] *= OVERRULED_PRIOR
        return prior

    @classmethod
    def cell(cls, flags: int, ratio: float, deep: bool, matched: int, seen: int = 0) -> int:
        """The cell of a node from its source flags, count ratio (or rank), whether its parent is a draft node, how
        many tokens of the context its tree's root matched and how often its n-gram was seen (0: unknown)."""
        top = cls.RATIO_BINS - 1
        follow = 1 if flags & FOLLOWED else 2 if flags & OVERRULED else 0
        flags &= ~(FOLLOWED | OVERRULED)
        if flags == RECYCLED:
            place = (cls.SOURCES - 1) * cls.RATIO_BINS + top - min(rank_of(ratio), top)
        else:
            source = 0 if flags & PROMPT else 1 if flags & OUTPUT else 2
            place = source * cls.RATIO_BINS + min(int(ratio * cls.RATIO_BINS), top)
        row = (place * cls.MATCH_BINS + min(max(matched, 1), cls.MATCH_BINS) - 1) * 2 + deep
        return (row * cls.SEEN_BINS + (seen != 1)) * cls.FOLLOW_BINS + follow

    @classmethod
    def cells(cls, tree: DraftTree) -> np.ndarray:
        """The cell of every node of `tree`."""
        nodes = zip(tree.sources, tree.ratios, tree.parents, tree.seen, strict=True)
        matched = tree.matched
        cells = [cls.cell(flags, ratio, parent > 0, matched, seen) for flags, ratio, parent, seen in nodes]
        return np.array(cells, dtype=np.int64)

    def rates(self, prior: np.ndarray) -> np.ndarray:
        with self._lock:
            return (self.accepted + self.weight * prior) / (self.sent + self.weight)

    @classmethod
    def observations(cls, tree: DraftTree, accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Cells, outcomes and the chances given, of the nodes whose parent verification kept (block indices)."""
        kept = np.zeros(len(tree) + 1, dtype=bool)
        kept[0] = True
        kept[list(accepted)] = True
        parents = np.asarray(tree.parents, dtype=np.int64)
        tried = kept[parents]
        path = np.concatenate([[1.0], tree.chances])
        edge = path[1:] / np.maximum(path[parents], 1e-12)  # a node's chance once its parent is accepted
        return cls.cells(tree)[tried], kept[1:][tried].astype(np.float64), edge[tried]

    def record(self, cells: np.ndarray, outcomes: np.ndarray) -> None:
        with self._lock:
            np.add.at(self.observed[0], cells, 1.0)
            np.add.at(self.observed[1], cells, outcomes)
            np.add.at(self.sent, cells, 1.0)
            np.add.at(self.accepted, cells, outcomes)
            self._halve_full()

    def add(self, sent: np.ndarray, accepted: np.ndarray) -> None:
        """Count observations made elsewhere (another replica's), as if they were made here (not `observed`)."""
        with self._lock:
            self.sent += sent
            self.accepted += accepted
            self._halve_full()

    def _halve_full(self) -> None:
        full = self.sent > self.HALVE_AT
        self.sent[full] /= 2
        self.accepted[full] /= 2


TRIE_PRIOR = Calibration.trie_prior()


class Level:
    """Draft nodes accepted over the nodes some rates expected, both fading: the factor those rates were off by.

    Scaling the rates by it brings them to what is accepted. With `neutral` nodes of even
    evidence it starts at 1.
    """

    def __init__(self, neutral: float) -> None:
        self.neutral = neutral
        self.accepted = 0.0
        self.expected = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + self.neutral) / (self.expected + self.neutral)

    def record(self, accepted: float, expected: float, fade: float) -> None:
        """Earlier evidence fades by `fade`, then this is added."""
        self.accepted = self.accepted * fade + accepted
        self.expected = self.expected * fade + expected


class RequestRates:
    """One request's own acceptance rates: per cell, and one level for all its cells that reacts in a few steps.

    A request's failures land in many cells (four sources by five ratio bins by matched length by depth), so
    per-cell counts alone learn slowly that this request's drafts fail. The level is the
    request's accepted nodes over the nodes its rates expected (both fading by LEVEL_FADE a
    step, with LEVEL_WEIGHT of neutral evidence), and scales the engine's rates in every
    cell, those of nodes never tried yet included: a chain whose first node keeps failing
    shrinks from six nodes to three in three steps and to none in ten (without the level: six
    nodes for eight steps, none after twelve), and a run of
    accepted copies raises it again. When it sends nothing the evidence fades, so it tries
    again later.
    """

    def __init__(self) -> None:
        self.calibration = Calibration(REQUEST_PRIOR_WEIGHT)
        self._level = Level(LEVEL_WEIGHT)
        self.paths = [Level(LEVEL_WEIGHT) for _ in range(DEPTH_BINS)]
        """Per depth, what this request's sent paths are off by once the engine's path levels scaled them."""

    @property
    def level(self) -> float:
        return self._level.value

    def rates(self, engine: np.ndarray) -> np.ndarray:
        return self.calibration.rates(np.minimum(engine * self.level, MOST_LIKELY))

    def record(self, cells: np.ndarray, outcomes: np.ndarray, expected: np.ndarray) -> None:
        """Outcomes of a step's tried nodes, and the chance each was given when it was sent."""
        self.calibration.record(cells, outcomes)
        self._level.record(float(outcomes.sum()), float(expected.sum()), LEVEL_FADE)

    def record_paths(self, hits: np.ndarray, given: np.ndarray) -> None:
        """Per depth bin, a step's accepted nodes and the path chances the engine's path levels gave them."""
        for depth, level in enumerate(self.paths):
            level.record(float(hits[depth]), float(given[depth]), LEVEL_FADE)

    def fade(self) -> None:
        """A step that sent nothing: the levels' evidence fades, as it does every step."""
        self._level.record(0.0, 0.0, LEVEL_FADE)
        for level in self.paths:
            level.record(0.0, 0.0, LEVEL_FADE)


LEVEL_WEIGHT = 3.0
"""Tried nodes of neutral evidence in a request's level."""
LEVEL_FADE = 0.9
"""A request's level forgets a step's evidence at this rate: it follows the last ten or so steps."""
MOST_LIKELY = 0.98
"""No edge is ever certain: a raised level must not make a long draft look free of risk."""
ENGINE_LEVEL_WEIGHT = 20.0
"""Tried nodes of neutral evidence in the engine's level."""
ENGINE_LEVEL_FADE = 0.998
"""The engine's level forgets a tried node's evidence at this rate: it follows the last few hundred nodes."""
DEPTH_BINS = 8
"""Path levels: one for each depth below DEPTH_BINS, one for all deeper nodes."""


def best_width(
    chances: Sequence[Sequence[float]],
    cost: StepCost,
    context: int = BASE_CONTEXT,
    worth: Sequence[float] | None = None,
) -> int:
    """Draft nodes per row worth sending: most expected tokens of all rows per predicted millisecond.

    `chances[b]` are row b's candidates' chances of acceptance, likeliest first. Every row of
    a batch pays for the widest row's block, so each row sends its first k nodes (fewer if it
    has fewer) for one k; 0 means plain decoding of every row this step. `context`: the
    longest row's cached tokens (the padded batch's length). `worth[b]`: what a token of row b
    is worth (default: every row's alike; see `DraftPolicy.worth`).
    """
    rows = len(chances)
    weights = np.ones(rows) if worth is None else np.asarray(worth, dtype=np.float64)
    widest = max(map(len, chances), default=0)
    gains = np.zeros(widest + 1)  # [0]: the plain step's row tokens; [k]: what every row's k-th node adds
    gains[0] = weights.sum()
    for weight, row in zip(weights, chances, strict=True):
        gains[1 : len(row) + 1] += weight * np.asarray(row, dtype=np.float64)
    rates = np.cumsum(gains) / cost.predict_widths(range(1, widest + 2), rows, context)
    return int(np.argmax(rates))  # the first best: a tie goes to the smaller block


def best_sizes(
    chances: Sequence[Sequence[float]],
    cost: StepCost,
    context: int = BASE_CONTEXT,
    worth: Sequence[float] | None = None,
) -> list[int]:
    """Draft nodes worth sending from each row of a packed batch, where a step costs by the tokens it carries.

    Each row pays only for its own nodes (decoding/slab.py), so the batch's candidates
    compete: the step sends the likeliest k of all rows' nodes for the k that gives most
    expected tokens per predicted millisecond, priced at the mean tokens a row. Each row's
    share is a prefix of its candidates (likeliest first): a row's later node never outranks
    its earlier one. `worth[b]`: what a token of row b is worth (default: every row's alike),
    so nodes rank by worth times chance.
    """
    rows = len(chances)
    weights = [1.0] * rows if worth is None else [float(weight) for weight in worth]
    falling = [_falling(values) for values in chances]
    counts = [len(values) for values in falling]
    row_of = np.repeat(np.arange(rows), counts)
    place = np.concatenate([np.arange(count) for count in counts]) if rows else np.zeros(0, dtype=np.int64)
    value = np.concatenate([np.zeros(0), *falling]) * np.repeat(weights, counts)
    order = np.lexsort((place, row_of, -value))  # most worth first; a tie: the earlier row, then the earlier node
    gains = np.cumsum(np.concatenate([[sum(weights)], value[order]]))
    widths = (rows + np.arange(len(order) + 1)) / rows
    best = int(np.argmax(gains / cost.predict_widths(widths, rows, context)))  # a tie goes to fewer nodes
    return np.bincount(row_of[order[:best]], minlength=rows).tolist()


FLOOR_PLACES = 64
"""Places of a one-row step's candidates that get a floor (a stop that late saves little)."""
FLOOR_SLACK = 1e-9
"""Floors are lowered by this fraction: `best_width` computes its rates otherwise, and at an exact tie rounding
must not leave out a node it would send."""
BEND = 1e-12
"""A curve bends where its second difference exceeds this share of its largest price: less is the rounding of
points interpolated on one straight stretch."""


def floor_factors(costs: Sequence[float], places: int = FLOOR_PLACES) -> np.ndarray:
    """Per place j in a one-row step's candidates (best first), the factor of its floor: node j is never sent below it.

    `costs[k]` is the predicted price of the step with k nodes (k = 0 … n); entry j - 1 of the
    result is f_j: node j is never in the prefix `best_width` sends unless its chance
    p_j ≥ f_j · (1 + the chances of the j - 1 nodes before it). Why: if the best prefix is m ≥ j
    nodes, it is worth at least the first j - 1: (1 + S_{j-1} + p_j + … + p_m) / C(m) ≥
    (1 + S_{j-1}) / C(j-1), and chances fall along the best-first order, so p_j + … + p_m ≤
    (m - j + 1) p_j. So retrieval can stop at the first node below its floor: nothing after it is sent.
    Places past `places` get 0 (no floor; the work is `places` x n, not n x n).

    Example: costs [10, 17, 24] (a second token 70 % of a step's price, a third 40 % more): a
    first node is sent only if p_1 ≥ min(0.7, 1.4 / 2) = 0.7, a second only if
    p_2 ≥ (24 / 17 - 1) (1 + p_1) = 0.41 (1 + p_1).
    """
    cost = np.asarray(costs, dtype=np.float64)
    n = len(cost) - 1
    factors = np.zeros(max(n, 0))
    floored = min(n, places)
    if floored < 1:
        return factors
    j = np.arange(1, floored + 1)[None, :]  # the place
    m = np.arange(1, n + 1)[:, None]  # a prefix the step might send
    ratios = np.where(m >= j, (cost[m] / cost[j - 1] - 1) / np.maximum(m - j + 1, 1), np.inf)
    factors[:floored] = np.maximum(ratios.min(axis=0), 0.0) * (1 - FLOOR_SLACK)
    return factors


def least_gain(costs: Sequence[float]) -> float:
    """The least a draft node must add for `best_sizes` ever to send it, as a share of the plain step's gains.

    `costs[m]` is the predicted price of a packed step carrying m draft nodes besides its rows'
    roots (m = 0 … n, n at least every node offered). A node worth v (its row's worth times its
    chance) is never sent unless v ≥ f · G0, G0 being the plain step's gains (the rows' worths
    summed). Why: say the best prefix of the nodes in value order has m nodes and this node is
    the (i + 1)-th. The prefix is worth at least its first i: (G_i + v + … ) / C(m) ≥ G_i / C(i)
    with the m - i nodes from it on worth at most v each, so v ≥ G_i · s, s = (C(m) / C(i) - 1) /
    (m - i); and G_i ≥ G0 + i · v (the i nodes before it are worth at least v), so v (1 - i s) ≥
    G0 · s: impossible where i s ≥ 1, else v ≥ G0 · s / (1 - i s). f is the least of these
    over 0 ≤ i < m ≤ n; on a straight curve it is a node's price over the plain step's. So a
    row's retrieval can stop at the first node under its share of that floor (DraftPolicy.least).

    Example: costs [100, 102, 104, 112]: from i = 0 the slopes s are 0.02, 0.02, 0.04; from i = 1
    0.0196 and 0.049, giving 0.02 and 0.052; from i = 2 0.077, giving 0.091; so f = 0.02, and in
    a step of 8 rows worth alike (G0 = 8 times a row's worth) a node needs a chance of 0.16.
    """
    cost = np.asarray(costs, dtype=np.float64)
    n = len(cost) - 1
    if n < 1:
        return 0.0
    if cost.min() <= 0:
        return 0.0  # a free step: no floor holds
    # For a fixed i, a chord's slope to m along a straight stretch of the curve changes monotonically with m, so
    # its least is at i + 1 or at a bend or the end: a measured curve has a few bends, not n.
    bends = np.flatnonzero(np.abs(np.diff(cost, 2)) > BEND * cost.max()) + 1
    ends = np.append(bends, n)[None, :]
    places = np.arange(n)
    chords = np.where(
        ends > places[:, None], (cost[ends] - cost[:-1, None]) / np.maximum(ends - places[:, None], 1), np.inf
    )
    s = np.minimum(chords.min(axis=1), np.diff(cost)) / cost[:-1]
    if (s <= 0).any():
        return 0.0
    fits = places * s < 1  # elsewhere no node could sit at place i
    if not fits.any():
        return 0.0
    return float((s[fits] / (1 - places[fits] * s[fits])).min()) * (1 - FLOOR_SLACK)


def _depth_bins(tree: DraftTree) -> np.ndarray:
    """Each node's path level: its depth less one, the deepest bin shared."""
    return np.minimum(np.asarray(tree.depths, dtype=np.int64), DEPTH_BINS) - 1


def _falling(values: Sequence[float]) -> np.ndarray:
    """`values` lowered where needed so that none exceeds an earlier one (the rank a prefix can be cut at)."""
    return np.minimum.accumulate(np.asarray(values, dtype=np.float64)) if len(values) else np.zeros(0)


def step_width(trees: Sequence[DraftTree], packed: bool) -> float:
    """Tokens a row the step's forward pass carries: the widest row's block, or for a packed batch the mean block."""
    if packed:
        return sum(len(tree) + 1 for tree in trees) / len(trees)
    return max(len(tree) for tree in trees) + 1


ENGINE_PRIOR_WEIGHT = 2.0
"""Observations the trie's own estimate is worth in an engine's calibration: trusted only at first."""
REQUEST_PRIOR_WEIGHT = 8.0
"""Observations the engine's rates are worth in a request's: a few steps of its own outweigh them."""


class DraftPolicy:
    """Engine-wide drafting state: the cost model and the calibration, shared by all requests.

    With no cost model the policy is fixed: the whole retrieved tree is sent, as the
    original Lookahead does.
    """

    def __init__(self, cost: StepCost | None = None) -> None:
        self.cost = cost
        self.calibration = Calibration(ENGINE_PRIOR_WEIGHT)
        self.level = Level(ENGINE_LEVEL_WEIGHT)
        """What the engine's own rates are off by, over every request's tried nodes (see `learn`)."""
        self.paths = [Level(ENGINE_LEVEL_WEIGHT) for _ in range(DEPTH_BINS)]
        """Per depth, what the chances of sent nodes' whole paths are off by, over every request (see `learn`)."""
        self._level_lock = threading.Lock()
        self.packed = False
        """True when batched rows are packed (each pays for its own nodes), not padded to the widest."""

    @property
    def adaptive(self) -> bool:
        return self.cost is not None

    @staticmethod
    def request_rates() -> RequestRates:
        """A new request's own rates, which start from the engine's."""
        return RequestRates()

    def rates(self, request: RequestRates) -> np.ndarray:
        """Per cell, the chance a node is accepted once its parent is, as `request` should expect it: the engine's
        rates times its level, as the request's own evidence corrects them."""
        return request.rates(np.minimum(self.calibration.rates(TRIE_PRIOR) * self.level.value, MOST_LIKELY))

    def fit(
        self, trees: Sequence[DraftTree], context: int = BASE_CONTEXT, last: Sequence[float] | None = None
    ) -> list[DraftTree]:
        """What each row sends of its candidates (likeliest first): the width worth its cost for all rows together.

        `context`: the cached tokens of the longest row. `last`: in a closed batch (nothing
        waits to join), each row's chance of ending last (decoding/ends.py); None: rows' tokens
        are worth alike.
        """
        if self.cost is None or not any(trees):
            return list(trees)
        chances = [tree.chances for tree in trees]
        worth = None if last is None else self.worth(last, context)
        if self.packed and len(trees) > 1:
            sizes = best_sizes(chances, self.cost, context, worth)
            return [tree.prefix(size) for tree, size in zip(trees, sizes, strict=True)]
        size = best_width(chances, self.cost, context, worth)
        return [tree.prefix(size) for tree in trees]

    def least(
        self, rows: int, budget: int, context: int = BASE_CONTEXT, last: Sequence[float] | None = None
    ) -> list[float] | None:
        """Per row of a packed step of `rows` rows offering at most `budget` nodes each, the least chance a node needs
        for `fit` ever to send it (`least_gain`): retrieval stops below it. None where no such floor holds: the
        fixed policy, a row alone (its own floors do more: `floors`) or padded rows (a rank is sent for all rows
        together, so a row's node may ride on the others'). As with `floors`, a step observed meanwhile by another
        thread could only make a floor leave out a node the fit would have sent: outputs stay exact."""
        if self.cost is None or rows < 2 or not self.packed:
            return None
        weights = np.ones(rows) if last is None else self.worth(last, context)
        costs = self.cost.predict_widths((rows + np.arange(rows * budget + 1)) / rows, rows, context)
        floor = least_gain(costs) * float(weights.sum())
        return [floor / weight if weight > 0 else float(floor > 0) for weight in weights.tolist()]

    def worth(self, last: Sequence[float], context: int = BASE_CONTEXT) -> np.ndarray:
        """Milliseconds a token of each row of a closed batch takes off the batch, by its chance of ending last.

        A row ending a step sooner saves, if it is the last, the step of one row it would have
        run alone; if not, only its share of the steps it leaves early: what a row adds to a
        plain step of this many rows, by the cost curves. With equal chances this is a step's
        price over its rows, an open batch's valuation, and no row is worth more than that: the
        chances are estimates (a row's pace drops when it stops drafting), and rows thought
        last, valued above it, drafted more than they paid back in replays of recorded answers.
        """
        assert self.cost is not None
        chances = np.asarray(last, dtype=np.float64)
        rows = len(chances)
        alone, together = self.cost.predict_widths([1], 1, context)[0], self.cost.predict_widths([1], rows, context)[0]
        share = max(float(together - alone), 0.0) / max(rows - 1, 1)
        return np.minimum(share + chances * max(float(alone) - share, 0.0), float(together) / rows)

    def floors(self, budget: int, context: int) -> list[float] | None:
        """For a row alone in its step, after `context` cached tokens: `floor_factors` of up to `budget` nodes
        (None for the fixed policy, which sends the whole tree).

        The floors and the step's `fit` price by the cost model as it is between the two; a step
        observed meanwhile by another thread could only make a floor leave out a node the fit would
        have sent (the output stays exact: drafts never change tokens)."""
        if self.cost is None:
            return None
        return floor_factors(self.cost.predict_widths(range(1, budget + 2), 1, context)).tolist()

    def learn(self, tree: DraftTree, accepted: Sequence[int], request: RequestRates) -> None:
        """Calibrate, engine-wide and for the request, by what verification kept of `tree` (block indices).

        The engine's level compares the accepted nodes with what the engine's rates alone gave them. A cell's rate
        is its own record, yet the nodes sent are those that looked likeliest just then (their cells, their
        requests), so the rates they are sent at run hopeful, by a share one factor over all requests follows.
        Measured against the rates it does not scale, the level settles at that share.

        The same selection compounds down a path: a node is grown further when it looks likely, so the deeper a
        sent node, the more hopeful its path's chance, though each edge's rate is right once its parent is
        accepted — by how much depends on the text (long copies stay right deep down). So every sent node's
        outcome also counts against its path's chance by depth: engine-wide against the chance as drafted, and
        for the request against that chance times the engine's path level (`path_discount`). `tree` holds the
        chances as drafted, before any discount."""
        if self.cost is None:
            return
        if not len(tree):  # most rows of a batch, most steps: nothing to count
            request.fade()
            return
        cells, outcomes, expected = Calibration.observations(tree, accepted)  # once for both
        engine = self.calibration.rates(TRIE_PRIOR)[cells]
        bins = _depth_bins(tree)
        kept = np.zeros(len(tree))
        kept[np.asarray(accepted, dtype=np.int64) - 1] = 1.0
        sent = np.bincount(bins, minlength=DEPTH_BINS)
        hits = np.bincount(bins, kept, minlength=DEPTH_BINS)
        given = np.bincount(bins, np.asarray(tree.chances, dtype=np.float64), minlength=DEPTH_BINS)
        with self._level_lock:
            self.level.record(float(outcomes.sum()), float(engine.sum()), ENGINE_LEVEL_FADE ** len(cells))
            paths = np.array([level.value for level in self.paths])
            for depth in np.flatnonzero(sent).tolist():
                self.paths[depth].record(float(hits[depth]), float(given[depth]), ENGINE_LEVEL_FADE ** int(sent[depth]))
        request.record_paths(hits, given * paths)
        self.calibration.record(cells, outcomes)
        request.record(cells, outcomes, expected)

    def path_discount(self, request: RequestRates) -> np.ndarray:
        """Per depth bin, what a node's path chance is worth to `request`: the engine's path level times the
        request's, never above 1 (retrieval's floors and `least` judged the chances as drafted: no node they left
        out may be worth more) nor above a shallower depth's (a child is never worth more than its parent)."""
        with self._level_lock:
            engine = np.array([level.value for level in self.paths])
        own = np.array([level.value for level in request.paths])
        return np.minimum.accumulate(np.minimum(engine * own, 1.0))

    def discounted(self, tree: DraftTree, request: RequestRates) -> np.ndarray:
        """Per node of `tree`, the factor its chance is worth to `request` (`path_discount` at its depth)."""
        return self.path_discount(request)[_depth_bins(tree)]

    def observe(self, trees: Sequence[DraftTree], milliseconds: float, context: int = BASE_CONTEXT) -> None:
        """What the step that verified `trees` together (after `context` cached tokens at most) cost."""
        if self.cost is not None:
            self.cost.observe(step_width(trees, self.packed), milliseconds, len(trees), context)
