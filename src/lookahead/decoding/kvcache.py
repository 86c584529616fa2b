"""Keep the accepted entries of a transformers cache after a tree forward pass.

After verifying a block of q entries (root + draft), the cache holds all q; only the root
and the accepted nodes belong to the sequence. They are moved down in place, and the tail
is cut, so no copy of the older cache is made.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> Cache:
    """An empty cache that records the full past on sliding-window layers.

    Sliding layers otherwise forget tokens beyond their window during the tree forward,
    before we know which of the block's entries will be kept.
    """
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
    return cache


def keep_accepted(cache: Cache, block_size: int, accepted: list[int]) -> None:
    """Drop the last `block_size` entries except the root and the `accepted` block indices."""
    kept = len(accepted) + 1
    moved = accepted if accepted != list(range(1, kept)) else []
    offsets: dict[torch.device, torch.Tensor] = {}  # one host-to-device copy per device, not per layer
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        stored = layer.keys.shape[-2]
        start = stored - block_size
        if moved:
            device = layer.keys.device
            if device not in offsets:
                offsets[device] = torch.tensor(moved, device=device)
            source = offsets[device] + start
            layer.keys[..., start + 1 : start + kept, :] = layer.keys.index_select(-2, source)
            layer.values[..., start + 1 : start + kept, :] = layer.values.index_select(-2, source)
        end = start + kept
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length -= block_size - kept
            end_window = max(end - (layer.sliding_window - 1), 0)
            layer.keys = layer.keys[..., end_window:end, :]
            layer.values = layer.values[..., end_window:end, :]
        else:
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]
