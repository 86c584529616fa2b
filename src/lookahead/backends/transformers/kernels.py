"""Which kernels the engine's passes run where that differs by machine: measured once per model and machine.

Linear layers: the model's own, or packed ones (linears.py) where they are faster. `auto`
decides by whole passes of a few widths, the two kinds taking turns, fastest of each. Where the
model's own layers win the narrow passes and packed ones the wider (a BLAS with a fast one-row
path, slow for a few rows), passes are routed by their number of tokens: from the narrowest
measured width packed layers win, and win at every wider one, the packed layers; below it, the
model's. The verdict is also kept with the model's packed layers, so later engines on the same
model in this process do not measure again.

Grouped heads: whether a batch's blocks attend each group of query heads as one head
(attention._torch_sdpa). Some CPUs' attention kernels work much faster so; on others laying the
queries and masks out costs what the kernel saves. Whole batched passes, both ways taking turns.

Each verdict is kept in the cost cache beside the curves (one measured while the rest of the
machine was busy is not, and is measured again at the next start).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from ...config import LINEARS
from ...decoding.costs import cache_path, read_cache, write_cache
from ...decoding.load import OthersLoad
from ...drafting.policy import BASE_CONTEXT
from .capability import Layout
from .costs import ModelMeter, runtime_key
from .forward import ModelForward
from .linears import PackedLinears, available, packed_linears

DRAFT_WIDTHS = (1, 2, 4, 8)
"""Pass widths the choice is timed at where the model verifies drafts: a plain step and the drafts a CPU sends."""
CHOICE_REPEATS = 3
GROUPING_WIDTHS = (2, 4)
"""Pass widths the grouped-heads choice is timed at: one draft node a row (the commonest drafting pass) and three."""
GROUPING_REPEATS = 5
GROUPING_MOST_ROWS = 16
"""Rows of the batched passes the grouped-heads choice is timed on, at most (a wider batch is timed at this)."""
_GROUPING_VERDICTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()
"""groups_as_heads' verdicts in this process, per model, so later engines on it do not read the cache again."""
log = logging.getLogger("lookahead.kernels")


def packed_candidate(forward: ModelForward, setting: str) -> PackedLinears | None:
    """The model's packed layers if `setting` (LookaheadConfig.linears) may use them and any layer packs, else None.

    The engine probes the model with them (the path it will most likely run), then `packed_from` decides 'auto'.
    """
    if setting not in LINEARS:
        raise ValueError(f"linears must be one of {', '.join(LINEARS)}, got {setting!r}")
    if setting == "model":
        return None
    if not available():
        if setting == "packed":
            log.warning("this torch has no oneDNN packed linear layers: the model's own are used")
        return None
    return packed_linears(forward.model) or None


def packed_from(forward: ModelForward, packed: PackedLinears, widths: Sequence[int]) -> int | None:
    """The fewest tokens a pass needs for `packed` layers to be faster than the model's own (measured at `widths`,
    and faster at every wider one measured); None where the model's own win at the widest."""
    key = runtime_key(forward)  # '' for a model without a name: measured every start, as its cost curves are
    name = f"{key}|linears={packed.kind}|torch={torch.__version__}|widths={tuple(widths)}" if key else None
    # in this process, with dtype and threads said even where the key is empty (a model may change dtype)
    remembered = f"{key}|{forward.model.dtype}|threads={torch.get_num_threads()}|widths={tuple(widths)}"
    if remembered not in packed.verdicts:
        packed.verdicts[remembered] = _verdict(forward, packed, widths, name)
    return packed.verdicts[remembered]


def _verdict(forward: ModelForward, packed: PackedLinears, widths: Sequence[int], name: str | None) -> int | None:
    """`packed_from`'s answer: from the cache entry `name`, else measured. An entry of older code, or not one of
    `widths` or None, is measured again."""

    def measure() -> tuple[int | None, dict]:
        times = time_both(forward, packed, widths)
        return packed_wins_from(times["packed"], times["model"]), times

    def valid(width: object) -> bool:
        return width is None or (type(width) is int and width in widths)

    return _cached_verdict(name, "packed_from", valid, measure)


def _cached_verdict(name: str | None, field: str, valid: Callable[[object], bool], measure: Callable[[], tuple]):
    """The verdict `field` of the cache entry `name` where `valid`, else `measure()`'s (verdict, times), kept under
    `name` if the rest of the machine was quiet meanwhile (with `name` None: measured, not kept)."""
    cached = read_cache(cache_path()).get(name) if name else None
    if isinstance(cached, dict) and field in cached and valid(cached[field]):
        return cached[field]
    load = OthersLoad()
    verdict, times = measure()
    if name and load.quiet():
        entries = read_cache(cache_path())
        entries[name] = {field: verdict, "ms": times, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_cache(cache_path(), entries)
    return verdict


def groups_as_heads(forward: ModelForward, layout: Layout, rows: int) -> bool:
    """Whether a batch's blocks attend faster with each group of query heads as one head (attention._torch_sdpa) than
    head by head: batched passes of `rows` rows (at most GROUPING_MOST_ROWS) in `layout`, timed both ways."""
    rows = min(rows, GROUPING_MOST_ROWS)
    key = runtime_key(forward)
    name = f"{key}|groups-as-heads|{layout}|rows={rows}|torch={torch.__version__}" if key else None
    # in this process, with dtype and threads said even where the key is empty (a model may change dtype)
    remembered = f"{key}|{forward.model.dtype}|threads={torch.get_num_threads()}|{layout}|rows={rows}"
    verdicts = _GROUPING_VERDICTS.setdefault(forward.model, {})

    def measure() -> tuple[bool, dict]:
        times = time_grouping(forward, layout, rows)
        return sum(times["group"].values()) < sum(times["head"].values()), times

    if remembered not in verdicts:
        verdicts[remembered] = _cached_verdict(name, "groups_as_heads", lambda v: type(v) is bool, measure)
    return verdicts[remembered]


def time_grouping(forward: ModelForward, layout: Layout, rows: int) -> dict[str, dict[int, float]]:
    """Milliseconds of the fastest of GROUPING_REPEATS passes of `rows` rows of each of GROUPING_WIDTHS tokens after
    BASE_CONTEXT cached ones, with each group of query heads as one head ("group") and head by head ("head"): widths
    and ways taking turns, pass by pass."""
    chosen = forward.groups_as_heads

    def grouped(way: bool) -> Callable[[], None]:
        return lambda: setattr(forward, "groups_as_heads", way)

    try:
        passes = ModelMeter(forward, layout).passes(rows, BASE_CONTEXT)
        return _fastest_in_turn(
            passes, GROUPING_WIDTHS, GROUPING_REPEATS, {"group": grouped(True), "head": grouped(False)}
        )
    finally:
        forward.groups_as_heads = chosen


def packed_wins_from(packed: dict[int, float], model: dict[int, float]) -> int | None:
    """The narrowest width from which `packed` is faster at every wider measured width; None if not at the widest.

    A BLAS with a fast one-row path and a slow few-row one loses to packed layers only from some width on; a
    width packed wins below one it loses does not count (one rule for a range of widths, not a patchwork).
    """
    start = None
    for width in sorted(packed, reverse=True):
        if packed[width] >= model[width]:
            break
        start = width
    return start


def time_both(
    forward: ModelForward,
    packed: PackedLinears,
    widths: Sequence[int],
    context: int = BASE_CONTEXT,
    repeats: int = CHOICE_REPEATS,
) -> dict[str, dict[int, float]]:
    """Milliseconds of the fastest of `repeats` one-row passes of each width after `context` cached tokens, with
    the model's layers ("model") and the packed ones ("packed"): widths and kinds taking turns, pass by pass."""
    chosen = forward.linears, forward.packed_from
    forward.packed_from = 1

    def routed(linears: PackedLinears | None) -> Callable[[], None]:
        return lambda: setattr(forward, "linears", linears)

    try:
        passes = ModelMeter(forward).passes(1, context)
        return _fastest_in_turn(passes, widths, repeats, {"model": routed(None), "packed": routed(packed)})
    finally:
        forward.linears, forward.packed_from = chosen


def _fastest_in_turn(
    passes: contextlib.AbstractContextManager[Callable[[int], None]],
    widths: Sequence[int],
    repeats: int,
    ways: dict[str, Callable[[], None]],
) -> dict[str, dict[int, float]]:
    """Milliseconds of the fastest of `repeats` of the meter's passes of each width, each way set up by its function
    just before its pass: widths and ways taking turns, pass by pass (a machine's slow spells fall on all)."""
    times: dict[str, dict[int, list[float]]] = {way: {width: [] for width in widths} for way in ways}
    with passes as run:
        for _ in range(repeats):
            for width in widths:
                for way, set_up in ways.items():
                    set_up()
                    clock = time.perf_counter()
                    run(width)
                    times[way][width].append((time.perf_counter() - clock) * 1000)
    return {way: {width: round(min(runs), 3) for width, runs in by_width.items()} for way, by_width in times.items()}
