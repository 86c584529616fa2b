"""Greedy choices without the output layer's whole float32 product, the same tokens.

A greedy step needs of the output layer only each position's largest logit, yet its float32
product reads the layer's whole weight (a vocabulary of rows) and, for the dozens of positions of
a batch's pass, costs as many multiply-adds as a few decoder layers. Here the product is made
first from bfloat16 copies (half the weight to read; the CPU's matrix units where it has them),
every logit with a proven bound on how far it can be from its float32 value, and only the tokens
whose bound reaches the highest lower end are made again in float32 by the row kernel — the bits
the full product gives them — so each choice is the full product's first largest logit, always
(argmaxhead.cpp has the argument). Where oneDNN lacks bfloat16, where it is not faster (timed on
the model's own weight at the first pass wide enough), or where a pass is too narrow for it to pay
(a batch's passes are where it does), the full product is made.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import ModuleType

import torch

from . import rowkernel
from .linears import packable_dtypes

_UNIT = 2.0**-8
"""bfloat16's unit roundoff (8 significant bits): a weight or activation rounded to it moves by at most this share."""
_FLOAT_UNIT = 2.0**-24
_TINY = 2.0**-125
"""Twice the smallest normal float: what a value flushed to zero (bfloat16 instructions flush subnormals) can lose,
on either side's product."""
_SAFETY = 1.01
"""Covers the rounding of the bound's own float32 arithmetic many times over."""
MOST_CANDIDATES = 4096
"""More tokens within reach than this (all rows together), and the whole product is cheaper."""
SWITCH_ROWS = (16, 24, 32, 48, 64)
"""Pass widths (rows x tokens) timed both ways at a head's first pass that wide. Narrower passes keep the whole
product: in a whole pass (its weights just read, the caches cold) the bfloat16 product did not pay below 16
positions where timed (benchmarks/NOTES.md), though alone it may."""
_CHUNK = 8192
"""Weight rows whose lengths are taken at once (in float64: a copy of that many rows, not of the whole weight)."""


class ArgmaxHead:
    """The greedy choices of one output layer's float32 products; build with `of`."""

    def __init__(self, kernel: ModuleType, features: int) -> None:
        self._kernel = kernel
        self._features = features
        gamma = features * _FLOAT_UNIT / (1 - features * _FLOAT_UNIT)
        self._products = _SAFETY * (2 * _UNIT + _UNIT**2 + gamma * (1 + _UNIT) ** 2 + gamma)
        """Per unit of |x| |w|: both operands rounded to bfloat16, either product's float32 sums in any order."""
        self._relative = _SAFETY * _UNIT / (1 - _UNIT)
        """Per unit of |approximate logit|: the bfloat16 result's own rounding."""
        self._made: tuple[torch.Tensor, int, int, torch.Tensor | None, torch.Tensor | None] | None = None
        """The weight the copies were made from (held: a freed weight's successor may take its identity and
        address), its version and address then, its bfloat16 copy and its rows' lengths (None: not finite)."""
        self._start: int | bool | None = False
        """The fewest positions from which this head is faster than the whole product (False: not timed yet; None:
        never)."""

    @classmethod
    def of(cls, weight: torch.Tensor) -> ArgmaxHead | None:
        """A head for a float32 weight on the CPU where the row kernel is built and oneDNN computes bfloat16."""
        kernel = rowkernel.load()
        if kernel is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        return cls(kernel, weight.shape[1]) if torch.bfloat16 in packable_dtypes() else None

    def choices(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Each row's greedy choice (int64) of `hidden` (rows, features) times the row kernel's `weight` (+ `bias`):
        the full product's first largest logit; None where this pass should make the full product instead (too few
        rows to pay, a bias, values out of range)."""
        if bias is not None or hidden.dtype != torch.float32 or hidden.shape[0] < SWITCH_ROWS[0]:
            return None
        if self._start is False:
            self._start = self._timed_start(weight)
        if self._start is None or hidden.shape[0] < self._start:
            return None
        return self._choose(hidden.contiguous(), weight)

    def _choose(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        copy, norms = self._copies(weight)
        lengths = torch.linalg.vector_norm(hidden.double(), dim=-1)
        if norms is None or not torch.isfinite(lengths).all():
            return None
        approximate = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), copy, None, "none", [], "").float()
        root = math.sqrt(self._features)
        scales = ((lengths * self._products + _TINY * root) * _SAFETY).float()
        absolutes = (_TINY * (root * lengths + 2 * self._features + 2) * _SAFETY).float()
        return self._kernel.head_argmax(
            hidden, weight, approximate, scales, absolutes, norms, self._relative, MOST_CANDIDATES
        )

    def _copies(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight's bfloat16 copy (laid out for oneDNN) and its rows' lengths (rounded up), made again after any
        change to the weight."""
        made = self._made
        if made is None or made[0] is not weight or made[1] != weight._version or made[2] != weight.data_ptr():
            with torch.no_grad():
                rows = weight.detach()
                lengths = torch.cat([torch.linalg.vector_norm(chunk.double(), dim=-1) for chunk in rows.split(_CHUNK)])
                norms = (lengths * (1 + 2**-20)).float()
                norms = norms if torch.isfinite(norms).all() else None
                copy = torch.ops.mkldnn._reorder_linear_weight(rows.to(torch.bfloat16), None)
            self._made = made = (weight, weight._version, weight.data_ptr(), copy, norms)
        return made[3], made[4]

    def _timed_start(self, weight: torch.Tensor) -> int | None:
        """The fewest positions of SWITCH_ROWS from which this head is faster than the row kernel's whole product
        with this weight, timed on random activations (fastest of 5 each way); None: at none of them."""
        generator = torch.Generator().manual_seed(0)
        for rows in SWITCH_ROWS:
            hidden = torch.randn(rows, weight.shape[1], generator=generator)
            whole = _fastest(lambda hidden=hidden: self._kernel.linear(hidden, weight, None))
            ours = _fastest(lambda hidden=hidden: self._choose(hidden, weight))
            if ours < whole:
                return rows
        return None


def _fastest(run: Callable[[], object], times: int = 5) -> float:
    best = math.inf
    with torch.inference_mode():
        for _ in range(times):
            clock = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - clock)
    return best
