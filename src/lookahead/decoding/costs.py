"""What a forward pass of each width costs on a runtime: measured once, cached on disk.

The adaptive policy prices every draft node with these curves (drafting/policy.py: CostModel).
Each backend times its own passes through a `Meter`; what is generic lives here: which curves
a batch needs, the interleaved fastest-of-N timing, and the cache. Measuring takes from seconds
to a minute or two on a CPU, so the points are kept in the cache directory under the meter's
key (model, runtime, dtype, device, threads) and the passes; a damaged or foreign cache file is
measured anew. $LOOKAHEAD_COST_PASSES sets the passes: one starts five times sooner and prices
by a noisier curve, which the online correction of real steps then mends (the test suite runs
with one).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..drafting.policy import BASE_CONTEXT, CostModel
from ..models import cache_dir

COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # small widths are irregular on CPUs
COST_CONTEXTS = (1024, 4096)
"""Longer contexts the one-row curve is measured at too (those the model's context holds); BASE_CONTEXT is the first."""
BATCH_ROWS = (2, 4, 8, 16)
"""Row counts whose curves are measured, up to the first that holds a batch's most rows; more are extrapolated."""
BATCH_WIDTHS = (1, 2, 4, 8, 16, 32)
REPEATS = 5
PASSES_VARIABLE = "LOOKAHEAD_COST_PASSES"


class Meter(Protocol):
    """Forward passes of one model on one runtime, timed for its cost curves."""

    key: str
    """What the curves depend on (model, runtime, dtype, device, threads, ...); '' if unknown: measured every time."""
    batch_key: str
    """What batched curves depend on besides `key` (how rows share a pass)."""
    max_positions: int | None

    def passes(self, rows: int, context: int) -> contextlib.AbstractContextManager[Callable[[int], None]]:
        """Within it: a function that runs one pass of `rows` rows of `width` tokens after `context` cached tokens
        each (and waits for its logits), leaving the cache as it found it."""
        ...


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
    meter: Meter,
    widths: Sequence[int] = COST_WIDTHS,
    context: int = BASE_CONTEXT,
    repeats: int = REPEATS,
    rows: int = 1,
) -> dict[int, float]:
    """Milliseconds of the fastest of `repeats` passes of `rows` rows of each width, after `context` tokens.

    The widths take turns, one pass each a round, so a burst of other load on a shared
    machine slows one pass of many widths rather than every pass of a few: measured one
    width after another, 8 rows of 4 tokens once came out at 1.2x the cost of 8 rows of 1,
    and ran at 2.1x. The fastest pass, not the median: other tenants only ever slow a pass
    (with 20-40 % of the CPU stolen, medians of five put 4 rows of 4 above 4 rows of 16),
    and what the machine's load adds to every step is learned online from plain steps
    (CostModel.scale).
    """
    times: dict[int, list[float]] = {width: [] for width in widths}
    with meter.passes(rows, context) as run:
        for _ in range(repeats):
            for width in widths:
                clock = time.perf_counter()
                run(width)
                times[width].append((time.perf_counter() - clock) * 1000)
    return {width: round(min(spent), 3) for width, spent in times.items()}


def longer_contexts(meter: Meter) -> list[int]:
    """The COST_CONTEXTS this model's context holds with the widest measured pass."""
    most = meter.max_positions or 1 << 30
    return [length for length in COST_CONTEXTS if length + max(COST_WIDTHS) <= most]


def measure_contexts(meter: Meter, longest: int, repeats: int = REPEATS) -> dict[int, dict[int, float]]:
    """The one-row curve after `longer_contexts` cached tokens, up to the first that reaches `longest` (all a run
    of contexts up to `longest` is priced from, and no 4k-token measurement for short prompts)."""
    lengths = longer_contexts(meter)
    reach = next((i for i, length in enumerate(lengths) if length >= longest), len(lengths) - 1)
    return {length: measure_cost(meter, context=length, repeats=repeats) for length in lengths[: reach + 1]}


def cost_model(meter: Meter, max_batch: int = 1) -> CostModel:
    """The cost curves of this meter's model: one row at a few contexts and, for batches (`max_batch` > 1),
    `measured_rows(max_batch)` rows. Cached on disk."""
    passes = measuring_passes()
    key = f"{meter.key}|fastest-of={passes}"
    wanted: dict[str, Callable[[], dict[int, float]]] = {
        f"{key}|widths={COST_WIDTHS}": lambda: measure_cost(meter, repeats=passes)
    }
    contexts = longer_contexts(meter)
    for length in contexts:
        wanted[f"{key}|context={length}|widths={COST_WIDTHS}"] = lambda length=length: measure_cost(
            meter, context=length, repeats=passes
        )
    batch_rows = measured_rows(max_batch) if max_batch > 1 else ()
    for rows in batch_rows:
        wanted[f"{key}|rows={rows}|widths={BATCH_WIDTHS}{meter.batch_key}"] = lambda rows=rows: measure_cost(
            meter, BATCH_WIDTHS, repeats=passes, rows=rows
        )
    path = cache_dir() / "costs.json"
    known = _read(path)
    curves, measured = [], False
    for entry, measure in wanted.items():
        curve = known.get(entry) if meter.key else None
        if not _sound(curve):  # not measured yet here, or a damaged entry
            curve = known[entry] = measure()
            measured = True
        curves.append(curve)
    if meter.key and measured:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f".costs-{os.getpid()}.json")
            scratch.write_text(json.dumps(known, indent=1))
            scratch.replace(path)
    single, *others = curves
    longer = dict(zip(contexts, others[: len(contexts)], strict=True))
    per_rows = dict(zip(batch_rows, others[len(contexts) :], strict=True)) if batch_rows else None
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
