"""The KV cache of a packed batch: one preallocated slab per layer, a write cursor per row.

A padded batch (kvcache.py) appends every row's block at the longest row's column and runs
the widest row's width for every row: on a CPU, where each token a forward pass carries
costs about the same, a third of a drafting step's tokens at 8 rows were padding (fill 0.67
measured on the five mixed sets), and transformers' `DynamicCache` copied every layer's
cache to append each step. Here the rows' blocks are packed into one sequence of real tokens
(the linear layers see nothing else), each row's new entries are written into its own row
of the slab right after its cached ones (no copy of older entries), and attention reads per
row only what the row has: all roots in one call, each drafting row's nodes in one more
(attention.py: PACKED_SDPA) — padded to the widest row, attention cost a third more at one
row of 17 tokens beside seven of 1 than at eight of 3. Where the padding is small (many rows
drafting a few nodes each) every row's block goes in one padded call instead (OneCall): on a
CPU a call's own price is most of what a drafting row's call costs. After verification only
the accepted entries move, inside the row's block.

Capacity grows GROWTH_MARGIN columns past the longest row at a time, so a row costs what the
longest row's tokens need, and a little more. Rows leave by the later rows moving up in place,
which leaves the slab's last rows spare; a joining row's prefilled cache is copied into a spare
row (once per request), so in a full batch, where a row leaves before the next joins, a join
copies that row only — building a new slab copied every row's cache (0.15-0.19 s at 8 rows).
Spare rows are given up when the slab next grows.

Sliding-window layers (Gemma 3, Mistral) keep every row's full past here, like full layers:
a transformers sliding layer keeps one length for all rows, so it cannot hold rows of
different lengths. The window is applied by the masks instead (masks.packed_inputs: a key is
seen only within the window of the query's position), on the layers whose cache slid. The
price is memory: a row holds all its entries on those layers, not its last window of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .kvcache import GROWTH_MARGIN, BatchCache


class Draft(NamedTuple):
    """A row's draft nodes in a packed pass: attended on their own, over that row's entries only."""

    row: int
    start: int
    """Where the nodes begin among the packed tokens (right after the row's root)."""
    size: int
    mask: torch.Tensor
    """(1, 1, size, keys) additive: the row's cached entries, its root, and each node's own ancestors."""
    window_mask: torch.Tensor | None = None
    """The same within the sliding window of each node's position, for sliding layers; None: no layer slides."""


class OneCall(NamedTuple):
    """Every row's block (root and nodes) attended in one call, padded to the widest block: on a CPU a call's own
    price is most of what a drafting row's separate call costs, so where the padding is small this is cheaper."""

    gather: torch.Tensor
    """(rows x width,) the packed token at each padded place (a row's root where its block is shorter)."""
    scatter: torch.Tensor
    """(T,) each packed token's padded place."""
    width: int
    mask: torch.Tensor
    """(rows, 1, width, end) additive: each query sees what it sees in the roots' or its row's call."""


class Packing(NamedTuple):
    """Where the tokens of one packed forward pass are written, and how attention reads them per row."""

    rows: torch.Tensor
    """(T,) the slab row of each packed token."""
    columns: torch.Tensor
    """(T,) the slab column each token's key and value are written to."""
    roots: torch.Tensor
    """(B,) where each row's root is among the packed tokens: the roots attend together, one query a row."""
    root_mask: torch.Tensor
    """(B, 1, 1, end) additive: a row's root sees the row's cached entries and itself."""
    drafts: tuple[Draft, ...]
    end: int
    """Columns the roots' attention reads: the furthest any row's block reaches."""
    window_root_mask: torch.Tensor | None = None
    """`root_mask` within the sliding window of each root's position, for sliding layers; None: no layer slides."""
    sliding_layers: frozenset[int] = frozenset()
    """Indices of the layers whose attention reads the window masks."""
    token_reads: tuple[tuple[int, int], ...] | None = None
    """Where every token attends on its own, as its one-token step would (rows of chains in bfloat16: attention.py):
    (row, keys) per packed token, the row's first `keys` columns; None: roots and drafts attend as above."""
    one_call: OneCall | None = None
    """Where roots and drafts attend in one padded call instead (masks.packed_inputs decides); None: as above."""


class SlabLayer(CacheLayerMixin):
    """One layer's keys and values for all rows: (rows, heads, capacity, head dim), written where the packing says."""

    is_sliding = False  # transformers' notion: its sliding layers keep one length for all rows; see the module doc
    is_compileable = False

    def __init__(self, slab: SlabCache, keys: torch.Tensor, values: torch.Tensor, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        """The sliding window of this layer's attention (the packing's window masks apply); None: full attention."""
        self._slab = weakref.ref(slab)  # no cycle: a slab left behind by a join is freed at once, not by the collector
        self.hold(keys, values, keys.shape[0])
        self.is_initialized = True
        self.device = keys.device

    def hold(self, keys: torch.Tensor, values: torch.Tensor, rows: int) -> None:
        """Keep `keys` and `values` whole (their rows past `rows` spare, for joins) and use their first `rows` rows."""
        self.room = (keys, values)
        self.keys, self.values = keys[:rows], values[:rows]

    @property
    def spare_rows(self) -> int:
        return self.room[0].shape[0] - self.keys.shape[0]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a slab is built from prefilled rows")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the packed block's (1, heads, T, dim) states into their rows; all rows' states to the packing's end."""
        packing = self._slab().packing
        if packing is None:
            raise RuntimeError("a slab is written only by a packed forward pass")
        self.keys[packing.rows, :, packing.columns] = key_states[0].transpose(0, 1)
        self.values[packing.rows, :, packing.columns] = value_states[0].transpose(0, 1)
        return self.keys[..., : packing.end, :], self.values[..., : packing.end, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._slab().past + query_length, 0

    def get_seq_length(self) -> int:
        return self._slab().past

    def get_max_length(self) -> int:
        return -1


class SlabCache(Cache):
    """Rows of different lengths, each owned by a generation; the same surgery calls as `BatchCache`."""

    def __init__(
        self,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lengths: Sequence[int],
        owners,
        windows: Sequence[int | None] | None = None,
    ) -> None:
        if len(lengths) != len(owners):
            raise ValueError("one length per owner")
        windows = list(windows) if windows is not None else [None] * len(layers)
        if len({window for window in windows if window is not None}) > 1:
            raise ValueError("a packed batch takes one sliding window for all its sliding layers")
        super().__init__(
            layers=[SlabLayer(self, *states, window) for states, window in zip(layers, windows, strict=True)]
        )
        self.lengths = list(lengths)
        self.owners = list(owners)
        self.packing: Packing | None = None
        """Set by the forward pass that writes the next block (forward.py), for the layers' updates."""

    @property
    def cache(self) -> SlabCache:
        """The transformers cache the model is given: this one (a `BatchCache` wraps a `DynamicCache`)."""
        return self

    @property
    def past(self) -> int:
        return max(self.lengths)

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window, None for full attention."""
        return [layer.window for layer in self.layers]

    @property
    def window(self) -> int | None:
        """The sliding window of the layers that slide; None if none does."""
        return next((window for window in self.windows if window is not None), None)

    @property
    def sliding_layers(self) -> frozenset[int]:
        return frozenset(number for number, window in enumerate(self.windows) if window is not None)

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[-2]

    def reserve(self, widths: Sequence[int]) -> None:
        """Room for row b to write `widths[b]` entries after its own: GROWTH_MARGIN more columns than needed when short.

        Not doubling: every row holds the longest row's columns, so a doubled slab held up
        to twice what the tokens need; a copy every GROWTH_MARGIN tokens of the longest row
        costs far less than the steps in between.
        """
        needed = max(length + width for length, width in zip(self.lengths, widths, strict=True))
        if needed <= self.capacity:
            return
        columns = needed + GROWTH_MARGIN
        for layer in self.layers:
            layer.hold(_widened(layer.keys, columns), _widened(layer.values, columns), len(self.lengths))

    def keep(self, kept: Sequence[Sequence[int]], block_size: int = 0) -> None:
        """Keep, of row b's block (written after its entries), the indices `kept[b]` (root first, ascending)."""
        rows, targets, sources = [], [], []
        for row, (length, indices) in enumerate(zip(self.lengths, kept, strict=True)):
            for offset, index in enumerate(indices):
                if index != offset:
                    rows.append(row)
                    targets.append(length + offset)
                    sources.append(length + index)
        if rows:
            device = self.layers[0].keys.device
            row, target, source = (torch.tensor(v, device=device) for v in (rows, targets, sources))
            for layer in self.layers:
                for states in (layer.keys, layer.values):
                    states[row, :, target] = states[row, :, source]
        self.lengths = [length + len(indices) for length, indices in zip(self.lengths, kept, strict=True)]

    def select(self, owners: Sequence[Hashable]) -> SlabCache:
        """The rows of `owners`, in that order (this cache is consumed).

        Rows kept in their order (others left) move up in place, so a leave allocates nothing.
        """
        rows = [self.owners.index(owner) for owner in owners]
        if rows == list(range(len(self.owners))):
            return self
        if rows != sorted(rows):
            index = torch.tensor(rows, device=self.layers[0].keys.device)
            layers = [(layer.keys.index_select(0, index), layer.values.index_select(0, index)) for layer in self.layers]
            return SlabCache(layers, [self.lengths[row] for row in rows], owners, self.windows)
        for layer in self.layers:
            for states in (layer.keys, layer.values):
                for target, source in enumerate(rows):
                    if target != source:  # source > target: rows only move up
                        states[target].copy_(states[source])
            layer.hold(*layer.room, len(rows))
        self.lengths = [self.lengths[row] for row in rows]
        self.owners = list(owners)
        return self

    @classmethod
    def merge(cls, parts: Sequence[BatchCache | SlabCache]) -> SlabCache:
        """One slab of all rows of `parts` (padded batches or slabs), in order (the parts are consumed).

        Each layer is copied into its new slab and dropped from its part at once, so a join
        holds little more than one slab at its peak, not the old and the new one whole.
        """
        windows = _windows(parts[0])
        if any(_windows(part) != windows for part in parts[1:]):
            raise ValueError("the caches of one slab must have the same layers")
        first = parts[0]
        if isinstance(first, SlabCache) and first.has_room_for(parts[1:]):
            first.take_in(parts[1:])  # rows only left (`select` moved them in place), or joiners fit spare rows
            return first
        lengths = [length for part in parts for length in part.lengths]
        columns = max(max(lengths) + GROWTH_MARGIN, *(_stored(part) for part in parts))
        part_layers = [_layers(part) for part in parts]
        layers = []
        for number in range(len(part_layers[0])):
            pair = []
            for name in ("keys", "values"):
                states = [getattr(own[number], name) for own in part_layers]
                merged = states[0].new_zeros((len(lengths), states[0].shape[1], columns, states[0].shape[-1]))
                row = 0
                for own, state in zip(part_layers, states, strict=True):
                    stored = min(state.shape[-2], columns)
                    merged[row : row + state.shape[0], :, :stored] = state[..., :stored, :]
                    row += state.shape[0]
                    setattr(own[number], name, None)
                pair.append(merged)
                del states
            layers.append((pair[0], pair[1]))
        return cls(layers, lengths, [owner for part in parts for owner in part.owners], windows)

    def has_room_for(self, parts: Sequence[BatchCache | SlabCache]) -> bool:
        """Whether the rows of `parts` fit this slab's spare rows, within its columns."""
        rows = sum(len(part.lengths) for part in parts)
        columns = max((layer.keys.shape[-2] for part in parts for layer in _layers(part)), default=0)
        return rows <= self.layers[0].spare_rows and columns <= self.capacity

    def take_in(self, parts: Sequence[BatchCache | SlabCache]) -> None:
        """Copy the rows of `parts` into spare rows, after this slab's own (the parts are consumed)."""
        part_layers = [_layers(part) for part in parts]
        for number, layer in enumerate(self.layers):
            row = len(self.lengths)
            for own in part_layers:
                added = own[number].keys.shape[0]
                for room, name in zip(layer.room, ("keys", "values"), strict=True):
                    state = getattr(own[number], name)
                    room[row : row + added, :, : state.shape[-2]] = state
                    setattr(own[number], name, None)  # dropped as copied: a join holds one part's layer at most
                row += added
            layer.hold(*layer.room, row)
        self.lengths += [length for part in parts for length in part.lengths]
        self.owners += [owner for part in parts for owner in part.owners]


def _layers(part: BatchCache | SlabCache) -> list:
    layers = part.cache.layers
    if any(getattr(layer, "keys", None) is None for layer in layers):
        raise ValueError("a slab is built from caches whose every layer holds keys and values")
    if any(layer.keys.shape[-2] < part.past for layer in layers):
        # a sliding layer that dropped entries past its window (past recording off, or cropped)
        raise ValueError("a slab is built from caches that hold every row's full past on every layer")
    return layers


def _windows(part: BatchCache | SlabCache) -> list[int | None]:
    """Each layer's sliding window in `part`, None for full attention."""
    if isinstance(part, SlabCache):
        return part.windows
    return [layer.sliding_window if getattr(layer, "is_sliding", False) else None for layer in part.cache.layers]


def _stored(part: BatchCache | SlabCache) -> int:
    return part.capacity if isinstance(part, SlabCache) else 0


def _widened(states: torch.Tensor, columns: int) -> torch.Tensor:
    """`states` with `columns` columns, the new ones zero: masked keys must still be finite (NaN * 0 is NaN)."""
    if states.shape[-2] == columns:
        return states
    wider = states.new_zeros((*states.shape[:-2], columns, states.shape[-1]))
    wider[..., : states.shape[-2], :] = states
    return wider
