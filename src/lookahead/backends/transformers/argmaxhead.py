"""Greedy choices without the output layer's whole float32 product, the same tokens.

A greedy step needs of the output layer only each position's largest logit, yet its float32
product reads the layer's whole weight (a vocabulary of rows) and, for the dozens of positions of
a batch's pass, costs as many multiply-adds as a few decoder layers. Here the product is made
first from bfloat16 copies (half the weight to read; the CPU's matrix units where it has them),
every logit with a proven bound on how far it can be from its float32 value, and only the tokens
whose bound reaches the highest lower end are made again in float32 by the row kernel — the bits
the full product gives them — so each choice is the full product's first largest logit, always
(argmaxhead.cpp has the argument). Where the bfloat16 product is not faster (measured once per
weight shape: CPUs without bfloat16 instructions), or a pass is too narrow for it to pay (a
batch's passes are where it does), the full product is made.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from . import rowkernel

_UNIT = 2.0**-8
"""bfloat16's unit roundoff (8 significant bits): a weight or activation rounded to it moves by at most this share."""
_FLOAT_UNIT = 2.0**-24
_SAFETY = 1.01
"""Covers the rounding of the bound's own float32 arithmetic many times over."""
MOST_CANDIDATES = 4096
"""More tokens within reach than this (all rows together), and the full product is cheaper."""
SWITCH_ROWS = (16, 24, 32, 48, 64)
"""Pass widths (rows x tokens) timed both ways when a head is first built. Narrower passes keep the whole product: in
a whole pass (its weights just read, the caches cold) the bfloat16 product did not pay below 16 positions where timed
(benchmarks/NOTES.md), though alone it may."""


class ArgmaxHead:
    """The greedy choices of one output layer's float32 products; build with `of`."""

    def __init__(self, kernel, features: int) -> None:
        self._kernel = kernel
        gamma = features * _FLOAT_UNIT / (1 - features * _FLOAT_UNIT)
        self._products = _SAFETY * (2 * _UNIT + _UNIT**2 + gamma * (1 + _UNIT) ** 2 + gamma)
        """Per unit of |x| |w|: both operands rounded to bfloat16, either product's float32 sums in any order."""
        self._relative = _SAFETY * _UNIT / (1 - _UNIT)
        """Per unit of |approximate logit|: the bfloat16 result's own rounding."""
        self._made: tuple[tuple[int, int, int], torch.Tensor, torch.Tensor] | None = None
        """The weight's stamp (identity, version, address), its bfloat16 copy and its rows' lengths."""

    @classmethod
    def of(cls, weight: torch.Tensor) -> ArgmaxHead | None:
        """A head for float32 weights where the row kernel is built and the bfloat16 product is measured faster."""
        kernel = rowkernel.load()
        if kernel is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        return cls(kernel, weight.shape[1]) if pays_from(tuple(weight.shape)) is not None else None

    def choices(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Each row's greedy choice (int64) of `hidden` (rows, features) times the row kernel's `weight` (+ `bias`):
        the full product's first largest logit; None where this pass should make the full product instead (too few
        rows to pay, a bias, values out of range)."""
        start = pays_from(tuple(weight.shape))
        if start is None or hidden.shape[0] < start or hidden.dtype != torch.float32 or bias is not None:
            return None
        return self._choose(hidden.contiguous(), weight)

    def _choose(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        copy, norms = self._copies(weight)
        approximate = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), copy, None, "none", [], "").float()
        scales = (torch.linalg.vector_norm(hidden.double(), dim=-1) * self._products).float() * _SAFETY
        return self._kernel.head_argmax(hidden, weight, approximate, scales, norms, self._relative, MOST_CANDIDATES)

    def _copies(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's bfloat16 copy (laid out for oneDNN) and its rows' lengths (rounded up), made again after any
        change to the weight."""
        stamp = (id(weight), weight._version, weight.data_ptr())
        if self._made is None or self._made[0] != stamp:
            with torch.no_grad():
                lengths = torch.linalg.vector_norm(weight.double(), dim=-1) * (1 + 2**-20)
                copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)
                self._made = (stamp, copy, lengths.float())
        return self._made[1], self._made[2]


@functools.cache
def pays_from(shape: tuple[int, int]) -> int | None:
    """The fewest positions from which the bfloat16 product (with its bound) is faster than the row kernel's float32
    one for a weight of this shape, timed once on random values (fastest of 5 each way); None: at no width tried."""
    kernel = rowkernel.load()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    head = ArgmaxHead(kernel, shape[1])
    for rows in SWITCH_ROWS:
        hidden = torch.randn(rows, shape[1], generator=generator)
        full = _fastest(lambda hidden=hidden: kernel.linear(hidden, weight, None))
        ours = _fastest(lambda hidden=hidden: head._choose(hidden, weight))
        if ours < full:
            return rows
    return None


def _fastest(run, times: int = 5) -> float:
    best = math.inf
    with torch.inference_mode():
        for _ in range(times):
            clock = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - clock)
    return best
