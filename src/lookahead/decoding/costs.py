"""What a forward pass of each width costs on this model and device: measured once, cached on disk.

The adaptive policy prices every draft node with this curve (drafting/policy.py: CostModel).
Measuring takes from seconds to a minute or two on a CPU (the fastest of REPEATS passes over
every width, at a few contexts, and for batches at a few row counts), so the points are kept
in the cache directory under a key of the model, dtype, device, thread count and passes; a
damaged or foreign cache file is measured anew. $LOOKAHEAD_COST_PASSES sets the passes: one
starts five times sooner and prices by a noisier curve, which the online correction of real
steps then mends (the test suite runs with one).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..drafting.policy import BASE_CONTEXT, CostModel
from ..models import cache_dir
from .capability import Layout
from .forward import ModelForward
from .kvcache import BatchCache
from .slab import SlabCache

COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # small widths are irregular on CPUs
COST_CONTEXTS = (1024, 4096)
"""Longer contexts the one-row curve is measured at too (those the model's context holds); BASE_CONTEXT is the first."""
BATCH_ROWS = (2, 4, 8, 16)
"""Row counts whose curves are measured, up to the first that holds a batch's most rows; more are extrapolated."""
BATCH_WIDTHS = (1, 2, 4, 8, 16, 32)
REPEATS = 5
PASSES_VARIABLE = "LOOKAHEAD_COST_PASSES"


def measuring_passes() -> int:
    """Passes a curve is the fastest of: $LOOKAHEAD_COST_PASSES, else REPEATS."""
    text = os.environ.get(PASSES_VARIABLE, "").strip()
    if not text:
        return REPEATS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"${PASSES_VARIABLE} must be a whole number of passes, at least 1; got {text!r}")
    return int(text)


def measured_rows(max_batch: int) -> tuple[int, ...]:
    """The BATCH_ROWS measured for batches of at most `max_batch` rows: up to the first that holds them."""
    reach = next((i for i, rows in enumerate(BATCH_ROWS) if rows >= max_batch), len(BATCH_ROWS) - 1)
    return BATCH_ROWS[: reach + 1]


def measure_cost(
    forward: ModelForward,
    widths: Sequence[int] = COST_WIDTHS,
    context: int = BASE_CONTEXT,
    repeats: int = REPEATS,
    rows: int = 1,
    tree_masks: bool = True,
    packed: bool = False,
) -> dict[int, float]:
    """Milliseconds of the fastest of `repeats` forward passes of `rows` rows of each width, after `context` tokens.

    `packed`: the rows on a slab, their blocks packed (decoding/slab.py), as a packed batch steps.

    The widths take turns, one pass each a round, so a burst of other load on a shared
    machine slows one pass of many widths rather than every pass of a few: measured one
    width after another, 8 rows of 4 tokens once came out at 1.2x the cost of 8 rows of 1,
    and ran at 2.1x. The fastest pass, not the median: other tenants only ever slow a pass
    (with 20-40 % of the CPU stolen, medians of five put 4 rows of 4 above 4 rows of 16),
    and what the machine's load adds to every step is learned online from plain steps
    (CostModel.scale).
    """
    vocab = forward.vocab_size
    prefix = [(100 + 7 * i) % vocab for i in range(context)]
    times: dict[int, list[float]] = {width: [] for width in widths}
    with torch.inference_mode():
        cache = forward.new_cache()
        forward.rows(cache, [prefix] * rows, [None] * rows, [0] * rows, tree_masks, last_only=True)
        if packed:  # a slab's rows keep their length: a block is written after them and never kept
            cache = SlabCache.merge([BatchCache(cache, [context] * rows, list(range(rows)))])
        for _ in range(repeats):
            for width in widths:
                clock = time.perf_counter()
                blocks = [prefix[:width]] * rows
                logits = forward.rows(cache, blocks, [None] * rows, [context] * rows, tree_masks)
                [row.argmax(-1).tolist() for row in logits]  # as a step: waits for the device
                times[width].append((time.perf_counter() - clock) * 1000)
                if not packed:
                    cache.crop(-width)  # the context stays the same for every measurement
    return {width: round(min(spent), 3) for width, spent in times.items()}


def longer_contexts(forward: ModelForward) -> list[int]:
    """The COST_CONTEXTS this model's context holds with the widest measured pass."""
    most = getattr(forward.config, "max_position_embeddings", None) or 1 << 30
    return [length for length in COST_CONTEXTS if length + max(COST_WIDTHS) <= most]


def measure_contexts(forward: ModelForward, longest: int, repeats: int = REPEATS) -> dict[int, dict[int, float]]:
    """The one-row curve after `longer_contexts` cached tokens, up to the first that reaches `longest` (all a run
    of contexts up to `longest` is priced from, and no 4k-token measurement for short prompts)."""
    lengths = longer_contexts(forward)
    reach = next((i for i, length in enumerate(lengths) if length >= longest), len(lengths) - 1)
    return {length: measure_cost(forward, context=length, repeats=repeats) for length in lengths[: reach + 1]}


def cost_model(
    forward: ModelForward, batched: Layout | None = None, tree_masks: bool = True, max_batch: int = BATCH_ROWS[-1]
) -> CostModel:
    """The cost curves of this model on this device (one row at a few contexts; with a layout, batches of
    `measured_rows(max_batch)` rows).

    Cached on disk.
    """
    passes = measuring_passes()
    name = getattr(forward.config, "_name_or_path", "")
    key = f"{name}|{forward.model.dtype}|{forward.device}|threads={torch.get_num_threads()}|fastest-of={passes}"
    if forward.attention is not None:  # another attention function, other costs
        key += f"|attention={forward.attention}"
    wanted = {f"{key}|widths={COST_WIDTHS}": functools.partial(measure_cost, forward, repeats=passes)}
    contexts = longer_contexts(forward)
    for length in contexts:
        measure = functools.partial(measure_cost, forward, context=length, repeats=passes)
        wanted[f"{key}|context={length}|widths={COST_WIDTHS}"] = measure
    batch_rows = measured_rows(max_batch) if batched else ()
    for rows in batch_rows:
        packed = batched == "packed"
        measure = functools.partial(measure_cost, forward, BATCH_WIDTHS, repeats=passes, rows=rows,
                                    tree_masks=tree_masks, packed=packed)  # fmt: skip
        wanted[f"{key}|rows={rows}|widths={BATCH_WIDTHS}" + ("|packed" if packed else "")] = measure
    path = cache_dir() / "costs.json"
    known = _read(path)
    curves, measured = [], False
    for entry, measure in wanted.items():
        curve = known.get(entry) if name else None
        if not _sound(curve):  # not measured yet here, or a damaged entry
            curve = known[entry] = measure()
            measured = True
        curves.append(curve)
    if name and measured:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f".costs-{os.getpid()}.json")
            scratch.write_text(json.dumps(known, indent=1))
            scratch.replace(path)
    single, *others = curves
    longer = dict(zip(contexts, others[: len(contexts)], strict=True))
    per_rows = dict(zip(batch_rows, others[len(contexts) :], strict=True)) if batched else None
    return CostModel(single, per_rows, longer)


def _read(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _sound(curve: object) -> bool:
    try:
        CostModel(curve)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return False
    return True
