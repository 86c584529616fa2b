"""Which linear layers the engine's passes run: the model's own, or packed ones (linears.py) where they are faster.

`auto` decides by measurement, once per model and machine: whole passes of a few widths,
the two kinds taking turns, fastest of each. Where the model's own layers win the narrow passes
and packed ones the wider (a BLAS with a fast one-row path, slow for a few rows), passes are
routed by their number of tokens: from the narrowest measured width packed layers win, and win
at every wider one, the packed layers; below it, the model's. The verdict is kept in the cost
cache beside the curves (one measured while the rest of the machine was busy is not) and with
the model's packed layers, so later engines on the same model in this process do not measure
again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from ...config import LINEARS
from ...decoding.costs import cache_path, read_cache, write_cache
from ...decoding.load import OthersLoad
from ...drafting.policy import BASE_CONTEXT
from .costs import ModelMeter, runtime_key
from .forward import ModelForward
from .linears import PackedLinears, available, packed_linears

DRAFT_WIDTHS = (1, 2, 4, 8)
"""Pass widths the choice is timed at where the model verifies drafts: a plain step and the drafts a CPU sends."""
CHOICE_REPEATS = 3
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
    name = f"{key}|linears|torch={torch.__version__}|widths={tuple(widths)}" if key else None
    # in this process, with dtype and threads said even where the key is empty (a model may change dtype)
    remembered = f"{key}|{forward.model.dtype}|threads={torch.get_num_threads()}|widths={tuple(widths)}"
    if remembered not in packed.verdicts:
        packed.verdicts[remembered] = _verdict(forward, packed, widths, name)
    return packed.verdicts[remembered]


def _verdict(forward: ModelForward, packed: PackedLinears, widths: Sequence[int], name: str | None) -> int | None:
    """`packed_from`'s answer: from the cache entry `name`, else measured (and kept there if the machine was quiet;
    with `name` None, not kept). An entry of older code, or not one of `widths` or None, is measured again."""
    cached = read_cache(cache_path()).get(name) if name else None
    if isinstance(cached, dict) and "packed_from" in cached:
        width = cached["packed_from"]
        if width is None or (type(width) is int and width in widths):
            return width
    load = OthersLoad()
    times = time_both(forward, packed, widths)
    verdict = packed_wins_from(times["packed"], times["model"])
    if name and load.quiet():
        entries = read_cache(cache_path())
        entries[name] = {"packed_from": verdict, "ms": times, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_cache(cache_path(), entries)
    return verdict


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
    kinds = {"model": None, "packed": packed}
    times: dict[str, dict[int, list[float]]] = {kind: {width: [] for width in widths} for kind in kinds}
    chosen = forward.linears, forward.packed_from
    forward.packed_from = 1
    try:
        with ModelMeter(forward).passes(1, context) as run:
            for _ in range(repeats):
                for width in widths:
                    for kind, linears in kinds.items():
                        forward.linears = linears
                        clock = time.perf_counter()
                        run(width)
                        times[kind][width].append((time.perf_counter() - clock) * 1000)
    finally:
        forward.linears, forward.packed_from = chosen
    return {kind: {width: round(min(runs), 3) for width, runs in by_width.items()} for kind, by_width in times.items()}
