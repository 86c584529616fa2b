"""What a forward pass of each width costs on a runtime: measured once, cached on disk, held against real steps.

The adaptive policy prices every draft node with these curves (drafting/policy.py: CostModel).
Each backend times its own passes through a `Meter`; what is generic lives here: which curves
a batch needs, the interleaved fastest-of-N timing, and the cache. Measuring takes from seconds
to a minute or two on a CPU, so the points are kept in the cache directory under the meter's
key (model, runtime, dtype, device, threads) and the passes; a damaged or foreign cache file is
measured anew. $LOOKAHEAD_COST_PASSES sets the passes: one starts five times sooner and prices
by a noisier curve, which the online correction of real steps then mends (the test suite runs
with one).

A price list measured while something else ran would govern every later engine on the
machine, so an entry is trusted only if the rest of the machine was quiet while it was
measured (decoding/load.py), with implausible points timed again; an untrusted entry is
measured again at the next start that finds the machine quiet (on a busy one it is used as it
is: no better measurement could be made), and one that real steps on a quiet machine show to
be too dear is marked untrusted (CheckedCost).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from ..config import cache_dir
from ..drafting.policy import BASE_CONTEXT, CostModel
from .load import QUIET, OthersLoad

COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # small widths are irregular on CPUs
COST_CONTEXTS = (1024, 4096)
"""Longer contexts the one-row curve is measured at too (those the model's context holds); BASE_CONTEXT is the first."""
BATCH_ROWS = (2, 4, 8, 16)
"""Row counts whose curves are measured, up to the first that holds a batch's most rows; more are extrapolated."""
BATCH_WIDTHS = (1, 2, 4, 8, 16, 32)
REPEATS = 5
PASSES_VARIABLE = "LOOKAHEAD_COST_PASSES"
log = logging.getLogger("lookahead.costs")
PLAUSIBLE = 1.5
"""A pass may cost at most this many times one of twice its tokens or more (see `implausible`)."""
RECHECKS = 2
"""Times implausible points are measured again."""
ATTEMPTS = 2
"""Measurements of a curve at one start while the rest of the machine is busy (the fastest of them is kept)."""
QUIET_PROBE_S = 0.5
"""How long the machine is watched before an untrusted entry is measured again (on a busy one it is kept)."""
CHECK_STEPS = 32
"""Steps between two checks of the cached curves against the observed ones."""
CHECK_EVIDENCE = 8.0
"""Steps of one size (faded) a check needs before it doubts the curves."""
OVERPRICED = 0.75
"""Steps running under this share of their measured price, on a quiet machine, show curves measured under load."""
CACHE_ENTRIES = 256
"""Entries the cache file keeps, the last measured: a model file moved or replaced leaves its entries behind."""
WIDE_ENOUGH = 8.0
"""A curve ends at the first width whose pass costs this many one-token passes: wider ones are priced by carrying its
last segment on (the pass is then compute-bound, so near-linear), as no draft but a long sure copy would pay there.
Where a dtype has no fast kernels on the CPU (bfloat16 without bfloat16 instructions) the widest passes made a start
take minutes."""


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
    (CostModel.scale). Widths past the first that costs WIDE_ENOUGH one-token passes are
    left out (`widths` ascending, from 1).
    """
    times: dict[int, list[float]] = {width: [] for width in widths}
    with meter.passes(rows, context) as run:
        for _ in range(repeats):
            for width in list(times):
                clock = time.perf_counter()
                run(width)
                times[width].append((time.perf_counter() - clock) * 1000)
                if 1 in times and width > 1 and min(times[width]) >= WIDE_ENOUGH * min(times[1]):
                    times = {narrower: spent for narrower, spent in times.items() if narrower <= width}
                    break
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


def implausible(curve: Mapping[int, float]) -> list[int]:
    """Widths whose pass cost more than PLAUSIBLE times a pass of at least twice as many tokens.

    On CPUs a narrow pass can cost more than a wider one (the matrix kernels change with the
    width; BENCHMARKS.md has the curves), but not half again as much as one twice as wide: such
    a point was timed in a burst of other load.
    """
    return [w for w in sorted(curve) if any(curve[v] * PLAUSIBLE < curve[w] for v in curve if v >= 2 * w)]


def _fastest(*curves: Mapping[int, float]) -> dict[int, float]:
    """Each width's lowest time in any of `curves` (load only ever slows a pass)."""
    return {w: min(curve[w] for curve in curves if w in curve) for w in set().union(*curves)}


Measure = Callable[[Sequence[int]], dict[int, float]]
"""Times passes of the given widths: their milliseconds."""


def measure_entry(measure: Measure, widths: Sequence[int], earlier: object = None) -> dict:
    """A cache entry of the curve over `widths` (`measure(widths)` times them): implausible points timed again, the
    whole curve once more if the rest of the machine was busy meanwhile.

    Trusted when it was quiet; else the fastest of these passes and the `earlier` entry's, untrusted (measured again
    at the next start that finds the machine quiet).
    """
    curve: dict[int, float] = {}
    for _ in range(ATTEMPTS):
        load = OthersLoad()
        attempt = measure(widths)
        for _ in range(RECHECKS):
            if not (doubtful := implausible(attempt)):
                break
            attempt = _fastest(attempt, measure(doubtful))
        others = load.share()
        if others <= QUIET:
            return _entry(attempt, others, trusted=True)
        curve = _fastest(curve, attempt) if curve else attempt
    if _sound(earlier):
        curve = _fastest(curve, _points(earlier["ms"]))
    log.warning(
        "cost curve measured while other processes took %.0f%% of the CPU: used for now, measured again at the next "
        "start on a quiet machine (its fastest passes are kept)",
        100 * others,
    )
    return _entry(curve, others, trusted=False)


def _entry(curve: Mapping[int, float], others: float, trusted: bool) -> dict:
    return {
        "ms": {str(w): round(curve[w], 3) for w in sorted(curve)},
        "others": round(others, 3),
        "trusted": trusted,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def cost_model(meter: Meter, max_batch: int = 1) -> CostModel:
    """The cost curves of this meter's model: one row at a few contexts and, for batches (`max_batch` > 1),
    `measured_rows(max_batch)` rows. Cached on disk; an entry measured under load or found wrong by the steps
    of an earlier run is measured again (see CheckedCost)."""
    passes = measuring_passes()
    key = f"{meter.key}|fastest-of={passes}"
    wanted: dict[str, tuple[Sequence[int], Measure]] = {
        f"{key}|widths={COST_WIDTHS}": (COST_WIDTHS, lambda widths: measure_cost(meter, widths, repeats=passes))
    }
    contexts = longer_contexts(meter)
    for length in contexts:
        wanted[f"{key}|context={length}|widths={COST_WIDTHS}"] = (
            COST_WIDTHS,
            lambda widths, length=length: measure_cost(meter, widths, context=length, repeats=passes),
        )
    batch_rows = measured_rows(max_batch) if max_batch > 1 else ()
    for rows in batch_rows:
        wanted[f"{key}|rows={rows}|widths={BATCH_WIDTHS}{meter.batch_key}"] = (
            BATCH_WIDTHS,
            lambda widths, rows=rows: measure_cost(meter, widths, repeats=passes, rows=rows),
        )
    path = cache_path()
    known = read_cache(path)
    curves, priced, measured = [], {}, False
    quiet_now: bool | None = None  # asked once, only if an untrusted entry is there to be measured again
    for name, (widths, measure) in wanted.items():
        entry = known.get(name) if meter.key else None
        if not (_sound(entry) and entry["trusted"] is True):  # not measured yet, damaged, under load or found wrong
            busy = _sound(entry) and not (quiet_now := _quiet_now() if quiet_now is None else quiet_now)
            if not busy:  # on a busy machine the entry is used as it is: no better measurement now
                entry = known[name] = measure_entry(measure, widths, entry)
                measured = True
        priced[name] = entry["ms"]
        curves.append(_points(entry["ms"]))
    if meter.key and measured:
        write_cache(path, known)
    single, *others = curves
    longer = dict(zip(contexts, others[: len(contexts)], strict=True))
    per_rows = dict(zip(batch_rows, others[len(contexts) :], strict=True)) if batch_rows else None
    return CheckedCost(single, per_rows, longer, entries=(path, priced) if meter.key else None)


def _quiet_now(seconds: float = QUIET_PROBE_S) -> bool:
    """Whether the rest of the machine is quiet over the next `seconds` (so a measurement now can be trusted)."""
    load = OthersLoad()
    time.sleep(seconds)
    return load.quiet()


class CheckedCost(CostModel):
    """A CostModel from cached curves that holds them against the steps it prices.

    Every CHECK_STEPS steps, if the rest of the machine was quiet meanwhile: a size that ran
    under OVERPRICED times its measured price (with CHECK_EVIDENCE steps behind it) shows the
    curves were measured under load — other tenants only slow a pass — so their cache entries
    are marked untrusted and the next engine measures them again. This engine goes on with
    the online correction (CostModel.factor). Steps dearer than measured are not held against
    the curves: a packed batch's rows of unequal blocks cost more than their mean width's
    price, and a busy machine is what `scale` follows.
    """

    def __init__(self, *curves, entries: tuple[Path, dict[str, dict]] | None) -> None:
        super().__init__(*curves)
        self._entries = entries
        """The cache file and, by entry name, the points as read from it (the curves of this model)."""
        self._load = OthersLoad()
        self._since_check = 0
        self.doubt: str | None = None
        """Why the cached curves were found wrong (then marked so on disk), or None."""

    def observe(self, width: float, milliseconds: float, rows: int = 1, context: int = BASE_CONTEXT) -> None:
        super().observe(width, milliseconds, rows, context)
        self._since_check += 1
        if self._since_check >= CHECK_STEPS:
            self._check()

    def _check(self) -> None:
        quiet = self._load.quiet()
        self._load.restart()
        self._since_check = 0
        if not quiet or self.doubt is not None or self._entries is None:
            return
        if (doubt := self.overpriced(OVERPRICED, CHECK_EVIDENCE)) is None:
            return
        self.doubt = doubt
        log.warning("cached cost curves look measured under load (%s): measured again at the next start", doubt)
        path, priced = self._entries
        known = read_cache(path)
        for name, points in priced.items():
            if _sound(known.get(name)) and known[name]["ms"] == points:  # not measured again meanwhile
                known[name].update(trusted=False, doubt=doubt)
        write_cache(path, known)


def _points(curve: Mapping[str, float]) -> dict[int, float]:
    return {int(w): float(ms) for w, ms in curve.items()}


def cache_path() -> Path:
    """The file cost curves (and other measurements of a model on this machine) are kept in."""
    return cache_dir() / "costs.json"


def read_cache(path: Path) -> dict:
    """The cost cache file's entries by name; an unreadable or foreign file reads as none."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def write_cache(path: Path, known: dict) -> None:
    """The entries into the cost cache file, whole (written aside, then moved over it: a reader never sees half); past
    CACHE_ENTRIES, the last measured of them."""
    if len(known) > CACHE_ENTRIES:
        newest = sorted(known, key=lambda name: str(_field(known[name], "measured")), reverse=True)[:CACHE_ENTRIES]
        known = {name: known[name] for name in newest}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".costs-{os.getpid()}.json")
        scratch.write_text(json.dumps(known, indent=1))
        scratch.replace(path)


def _field(entry: object, name: str) -> object:
    return entry.get(name, "") if isinstance(entry, dict) else ""


def _sound(entry: object) -> bool:
    """An entry of the current format whose curve makes a CostModel."""
    if not isinstance(entry, dict):
        return False
    try:
        CostModel(entry["ms"])
    except (KeyError, ValueError, TypeError, AttributeError):
        return False
    return True
