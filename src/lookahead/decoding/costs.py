"""What a forward pass of each width costs on this model and device: measured once, cached on disk.

The adaptive policy prices every draft node with this curve (drafting/policy.py: CostModel).
Measuring takes a few seconds, so the points are kept in the cache directory under a key of
the model, dtype, device and thread count; a damaged or foreign cache file is measured anew.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Sequence

import torch

from ..drafting.policy import CostModel
from ..models import cache_dir
from .forward import ModelForward

COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # small widths are irregular on CPUs


def measure_cost(
    forward: ModelForward, widths: Sequence[int] = COST_WIDTHS, context: int = 128, repeats: int = 3
) -> dict[int, float]:
    """Median milliseconds of a forward pass of each width after `context` cached tokens."""
    vocab = forward.vocab_size
    prefix = [(100 + 7 * i) % vocab for i in range(context)]
    costs = {}
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, prefix, 0, last_only=True)
        for width in widths:
            times = []
            for _ in range(repeats):
                clock = time.perf_counter()
                forward(cache, prefix[:width], context).argmax(-1).tolist()  # as a step: waits for the device
                times.append((time.perf_counter() - clock) * 1000)
                cache.crop(-width)  # the context stays the same for every measurement
            costs[width] = round(statistics.median(times), 3)
    return costs


def cost_model(forward: ModelForward) -> CostModel:
    """The cost curve of this model on this device, measured once and cached on disk."""
    name = getattr(forward.config, "_name_or_path", "")
    dtype = forward.model.dtype
    key = f"{name}|{dtype}|{forward.device}|threads={torch.get_num_threads()}|widths={COST_WIDTHS}"
    path = cache_dir() / "costs.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if name and isinstance(known.get(key), dict):
        with contextlib.suppress(ValueError, TypeError):
            return CostModel(known[key])
    points = measure_cost(forward)
    if name:
        known[key] = points
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f".costs-{os.getpid()}.json")
            scratch.write_text(json.dumps(known, indent=1))
            scratch.replace(path)
    return CostModel(points)
