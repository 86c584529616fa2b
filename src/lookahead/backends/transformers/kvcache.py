"""The KV cache of one or several sequences, and the surgery a verified block needs.

`BatchCache` wraps one transformers cache whose rows are different sequences, left-aligned:
row b holds its `lengths[b]` entries at columns [0, lengths[b]) and garbage beyond, up to the
longest row. A step appends its block of q entries (root + draft) to every row at the same
column; afterwards only the root and the accepted nodes belong to each sequence, so they are
moved right after that row's own entries (one batched gather and scatter per layer) and the
tail is cut at the new longest row. No copy of the older cache is made.

Joining rows are concatenated on the batch dimension (padded to the common length) and
leaving rows are dropped by index, which transformers' cache has no call for.

Full-attention layers are `RoomLayer`s: transformers' `DynamicLayer` appends a block by
concatenation, copying the layer's whole cache every step; here a block is written into spare
columns after the entries, and only a full room is copied (into one with spare columns again).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

GROWTH_MARGIN = 128
"""Spare columns a cache gets past its longest row when it is built or outgrows its room, for the next blocks."""
_Block = tuple[tuple[int, int, int], torch.dtype, torch.device]
"""What a block written into a room must agree with: (batch, heads, head dim), dtype, device."""


def new_cache(model: PreTrainedModel) -> Cache:
    """An empty cache: full-attention layers with room to grow in place; sliding-window layers recording the full past.

    Sliding layers otherwise forget tokens beyond their window during the tree forward,
    before we know which of the block's entries will be kept.
    """
    cache = DynamicCache(config=model.config)
    for number, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()
        elif type(layer) is DynamicLayer:
            cache.layers[number] = RoomLayer()
    return cache


class RoomLayer(DynamicLayer):
    """A full-attention layer whose keys and values are the first columns of a larger room; a block is written after
    them in place.

    Every assignment of `keys` and `values` passes through here: one that is not the start of the room (a batch
    merged, rows selected, the layer emptied) lets the room go at once, and the next update copies what it was given
    into a new one. Cutting them (`crop`, compaction) keeps them the start of the room, and the next block overwrites
    what was cut. A room is made in the mode it is written in (one made under `torch.inference_mode()` cannot be
    written outside it).
    """

    def __init__(self) -> None:
        self._room: tuple[torch.Tensor, torch.Tensor] | None = None
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys

    @keys.setter
    def keys(self, states: torch.Tensor | None) -> None:
        self._keys = states
        self._keep_room(states, 0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._values

    @values.setter
    def values(self, states: torch.Tensor | None) -> None:
        self._values = states
        self._keep_room(states, 1)

    def _keep_room(self, states: torch.Tensor | None, part: int) -> None:
        """Let the room go unless `states` start where its keys (part 0) or values (part 1) do."""
        if self._room is not None and (states is None or states.data_ptr() != self._room[part].data_ptr()):
            self._room = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the block after the entries (into a new room first where it does not fit); all entries so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        width = key_states.shape[-2]
        if not self._holds(length + width, _block(key_states), _block(value_states)):
            self._room = (_roomy(self.keys, key_states, length), _roomy(self.values, value_states, length))
        keys, values = self._room
        keys.narrow(-2, length, width).copy_(key_states)
        values.narrow(-2, length, width).copy_(value_states)
        self.keys, self.values = keys.narrow(-2, 0, length + width), values.narrow(-2, 0, length + width)
        return self.keys, self.values

    def room_for(
        self, width: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys' and values' rooms where `update` would write a block of `width` columns, (batch, heads, dim)
        `shape`, `dtype` and `device`, in place; None where it would make a new room first. For a writer that fills
        the block itself, then `advance`s."""
        if not self.is_initialized:
            return None
        block = (shape, dtype, device)
        return self._room if self._holds(self.get_seq_length() + width, block, block) else None

    def advance(self, width: int) -> None:
        """The `width` columns after the entries, written in the room (`room_for`), are entries from now on."""
        keys, values = self._room
        end = self.get_seq_length() + width
        self.keys, self.values = keys.narrow(-2, 0, end), values.narrow(-2, 0, end)

    def _holds(self, end: int, key_block: _Block, value_block: _Block) -> bool:
        """Whether the room reaches `end`, takes blocks like these, and holds the entries at its start."""
        if self._room is None:
            return False
        inference = torch.is_inference_mode_enabled()
        for held, room, ((batch, heads, dim), dtype, device) in (
            (self.keys, self._room[0], key_block),
            (self.values, self._room[1], value_block),
        ):
            shape = room.shape
            if not (
                end <= shape[-2]
                and (batch, heads, dim) == (shape[0], shape[1], shape[-1])
                and dtype == room.dtype
                and device == room.device
                and room.is_inference() == inference
                and held.shape[:2] == shape[:2]
                and held.stride() == room.stride()
            ):
                return False
        return True


def _block(states: torch.Tensor) -> _Block:
    return (states.shape[0], states.shape[1], states.shape[-1]), states.dtype, states.device


def _roomy(held: torch.Tensor, block: torch.Tensor, length: int) -> torch.Tensor:
    """A new room for `length` held entries, a block like `block` and GROWTH_MARGIN columns more."""
    batch, heads, width, dim = block.shape
    if length and ((held.shape[:2], held.shape[-1], held.dtype) != ((batch, heads), dim, block.dtype)):
        raise ValueError(
            f"a block of {tuple(block.shape)} {block.dtype} cannot follow {tuple(held.shape)} {held.dtype}"
        )
    room = block.new_empty((batch, heads, length + width + GROWTH_MARGIN, dim))
    if length:
        room[..., :length, :] = held
    return room


def has_sliding_layers(cache: Cache) -> bool:
    """Sliding-window layers keep one length for all rows, so their caches cannot hold rows of different lengths."""
    return any(getattr(layer, "is_sliding", False) for layer in cache.layers)


def _live_layers(cache: Cache) -> list:
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", True) and layer.keys is not None]


class BatchCache:
    """A transformers cache holding one row per owner (a generation), each row with its own length."""

    def __init__(self, cache: Cache, lengths: Sequence[int], owners: Sequence[Hashable]) -> None:
        if len(lengths) != len(owners):
            raise ValueError("one length per owner")
        self.cache = cache
        self.lengths = list(lengths)
        self.owners = list(owners)
        self._sliding = has_sliding_layers(cache)

    @property
    def past(self) -> int:
        """Columns every row has (the longest row's length): where the next block is appended."""
        return max(self.lengths)

    def keep(self, kept: Sequence[Sequence[int]], block_size: int) -> None:
        """After a block of `block_size` entries was appended to every row, keep row b's block indices `kept[b]`.

        Each row's list starts with its root (0) and is ascending; the kept entries move, in
        order, to the columns right after the row's own entries.
        """
        past = self.past
        rows, targets, sources, lengths = [], [], [], []
        for row, (length, indices) in enumerate(zip(self.lengths, kept, strict=True)):
            for offset, index in enumerate(indices):
                if length + offset != past + index:
                    rows.append(row)
                    targets.append(length + offset)
                    sources.append(past + index)
            lengths.append(length + len(indices))
        end = max(lengths)
        if not rows and end == past + block_size and not self._sliding:  # every layer holds just that: nothing to cut
            self.lengths = lengths
            return
        indices_on: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # one host-to-device copy per device
        for layer in _live_layers(self.cache):
            stored = layer.keys.shape[-2]
            shift = stored - block_size - past  # below 0 where a sliding layer stores only its window
            if rows:
                device = layer.keys.device
                if device not in indices_on:
                    indices_on[device] = tuple(torch.tensor(v, device=device) for v in (rows, targets, sources))
                row_index, target, source = indices_on[device]
                for states in (layer.keys, layer.values):
                    states[row_index, :, target + shift] = states[row_index, :, source + shift]
            if getattr(layer, "is_sliding", False):
                if len(self.lengths) > 1:
                    raise ValueError("sliding-window layers cannot hold rows of different lengths")
                layer.cumulative_length -= block_size - len(kept[0])
                start = max(end + shift - (layer.sliding_window - 1), 0)
                layer.keys = layer.keys[..., start : end + shift, :]
                layer.values = layer.values[..., start : end + shift, :]
            else:
                layer.keys = layer.keys[..., :end, :]
                layer.values = layer.values[..., :end, :]
        self.lengths = lengths

    def select(self, owners: Sequence[Hashable]) -> BatchCache:
        """The rows of `owners`, in that order, trimmed to the longest of them (this cache is consumed)."""
        rows = [self.owners.index(owner) for owner in owners]
        if rows == list(range(len(self.owners))):
            return self
        lengths = [self.lengths[row] for row in rows]
        end = max(lengths)
        for layer in _live_layers(self.cache):
            index = torch.tensor(rows, device=layer.keys.device)
            layer.keys = layer.keys.index_select(0, index)[..., :end, :]
            layer.values = layer.values.index_select(0, index)[..., :end, :]
        return BatchCache(self.cache, lengths, owners)

    @classmethod
    def merge(cls, parts: Sequence[BatchCache]) -> BatchCache:
        """One cache of all rows of `parts`, in order (the parts are consumed)."""
        if len(parts) == 1:
            return parts[0]
        if any(has_sliding_layers(part.cache) for part in parts):
            raise ValueError("sliding-window layers cannot hold rows of different lengths")
        lengths = [length for part in parts for length in part.lengths]
        end = max(lengths)
        first = parts[0].cache
        live = {id(layer) for layer in _live_layers(first)}
        for number, layer in enumerate(first.layers):
            if id(layer) not in live:
                continue
            for name in ("keys", "values"):
                states = [getattr(part.cache.layers[number], name) for part in parts]
                padded = [F.pad(s, (0, 0, 0, end - s.shape[-2])) for s in states]
                setattr(layer, name, torch.cat(padded, dim=0))
        return cls(first, lengths, [owner for part in parts for owner in part.owners])
