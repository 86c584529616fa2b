"""BatchCache: keep each row's accepted entries after a block, join rows, drop rows; RoomLayer: blocks written in
place, equal to transformers' own layer."""

import pytest
import torch
from tiny_models import tiny_model
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from lookahead.backends.transformers.kvcache import GROWTH_MARGIN, BatchCache, RoomLayer, new_cache


@pytest.fixture(params=[RoomLayer, DynamicLayer])
def cache_with(request):
    """A one-layer cache of the engine's kind of layer or transformers' own, whose row b holds `rows[b]` (keys; values
    are keys * 10), padded with -1."""

    def make(*rows: list[float]) -> Cache:
        width = max(map(len, rows))
        states = torch.tensor([row + [-1.0] * (width - len(row)) for row in rows]).view(len(rows), 1, width, 1)
        cache = Cache(layers=[request.param()])
        cache.update(states.clone(), states.clone() * 10, layer_idx=0)
        return cache

    return make


def _rows(batch: BatchCache) -> list[list[float]]:
    keys = batch.cache.layers[0].keys
    return [keys[row, 0, :length, 0].tolist() for row, length in enumerate(batch.lengths)]


def test_keeps_root_and_accepted_in_order_and_drops_the_rest(cache_with):
    # 3 past entries, then a block of 5: root (100) and nodes 101..104
    batch = BatchCache(cache_with([1, 2, 3, 100, 101, 102, 103, 104]), [3], ["a"])
    batch.keep([[0, 2, 4]], block_size=5)
    layer = batch.cache.layers[0]
    assert layer.keys.flatten().tolist() == [1, 2, 3, 100, 102, 104]
    assert layer.values.flatten().tolist() == [10, 20, 30, 1000, 1020, 1040]
    assert batch.cache.get_seq_length() == 6 and batch.lengths == [6]


def test_prefix_acceptance_is_a_plain_cut(cache_with):
    batch = BatchCache(cache_with([1, 2, 100, 101, 102]), [2], ["a"])
    batch.keep([[0, 1]], block_size=3)
    assert batch.cache.layers[0].keys.flatten().tolist() == [1, 2, 100, 101]


def test_nothing_accepted_keeps_only_the_root(cache_with):
    batch = BatchCache(cache_with([1, 100, 101, 102]), [1], ["a"])
    batch.keep([[0]], block_size=3)
    assert batch.cache.layers[0].keys.flatten().tolist() == [1, 100]


def test_rows_of_different_lengths_keep_their_own_entries_right_after_their_past(cache_with):
    # row a: 4 cached, row b: 2 cached (then a gap of 2); the block of 3 went to column 4 of both
    batch = BatchCache(cache_with([1, 2, 3, 4, 10, 11, 12], [5, 6, -1, -1, 20, 21, 22]), [4, 2], ["a", "b"])
    batch.keep([[0, 2], [0, 1, 2]], block_size=3)
    assert batch.lengths == [6, 5]
    assert _rows(batch) == [[1, 2, 3, 4, 10, 12], [5, 6, 20, 21, 22]]
    assert batch.cache.layers[0].keys.shape[-2] == 6, "trimmed to the longest row"
    assert batch.cache.layers[0].values[1, 0, :5, 0].tolist() == [50, 60, 200, 210, 220]


def test_merge_pads_to_the_longest_and_select_drops_and_reorders_rows(cache_with):
    parts = [
        BatchCache(cache_with([1, 2, 3]), [3], ["a"]),
        BatchCache(cache_with([4]), [1], ["b"]),
        BatchCache(cache_with([5, 6], [7, 8]), [2, 2], ["c", "d"]),
    ]
    batch = BatchCache.merge(parts)
    assert batch.owners == ["a", "b", "c", "d"] and batch.lengths == [3, 1, 2, 2]
    assert _rows(batch) == [[1, 2, 3], [4], [5, 6], [7, 8]]
    batch = batch.select(["d", "b"])
    assert batch.owners == ["d", "b"] and _rows(batch) == [[7, 8], [4]]
    assert batch.cache.layers[0].keys.shape == (2, 1, 2, 1), "trimmed to the longest remaining row"


def test_one_length_per_owner(cache_with):
    with pytest.raises(ValueError, match="one length per owner"):
        BatchCache(cache_with([1]), [1, 1], ["a"])


def _block(start: int, width: int, rows: int = 1) -> torch.Tensor:
    return torch.arange(start, start + rows * 2 * width * 3, dtype=torch.float32).view(rows, 2, width, 3)


def _same_as_transformers(room: Cache, reference: DynamicCache) -> bool:
    return all(
        torch.equal(ours, theirs)
        for mine, its in zip(room.layers, reference.layers, strict=True)
        for ours, theirs in ((mine.keys, its.keys), (mine.values, its.values))
    )


def test_the_engine_caches_full_layers_in_rooms_and_keeps_sliding_ones():
    assert all(type(layer) is RoomLayer for layer in new_cache(tiny_model("llama")).layers)
    model = tiny_model("gemma2")  # every other layer slides
    kinds = [type(layer) is RoomLayer for layer in new_cache(model).layers]
    assert kinds == [kind == "full_attention" for kind in model.config.layer_types] and any(kinds) and not all(kinds)


def test_blocks_are_written_in_place_until_the_room_is_full_then_moved_whole():
    room, reference = Cache(layers=[RoomLayer()]), DynamicCache()
    for cache in (room, reference):
        cache.update(_block(0, 5), _block(1000, 5), layer_idx=0)
    storage = room.layers[0].keys.data_ptr()
    for step in range(GROWTH_MARGIN + 1):
        for cache in (room, reference):
            cache.update(_block(10 * step, 1), -_block(10 * step, 1), layer_idx=0)
        assert _same_as_transformers(room, reference)
        moved = room.layers[0].keys.data_ptr() != storage
        assert moved == (step == GROWTH_MARGIN), step  # a new room only when the block does not fit


def test_a_cut_is_overwritten_by_the_next_block():
    room, reference = Cache(layers=[RoomLayer()]), DynamicCache()
    for cache in (room, reference):
        cache.update(_block(0, 6), _block(100, 6), layer_idx=0)
    storage = room.layers[0].keys.data_ptr()
    for cache in (room, reference):
        cache.crop(-4)
        cache.update(_block(7, 2), _block(9, 2), layer_idx=0)
    assert _same_as_transformers(room, reference) and room.get_seq_length() == 4
    assert room.layers[0].keys.data_ptr() == storage, "written in place"


def test_entries_replaced_from_outside_are_copied_into_a_new_room_and_never_written_to():
    room, reference = Cache(layers=[RoomLayer()]), DynamicCache()
    for cache in (room, reference):
        cache.update(_block(0, 4, rows=3), _block(50, 4, rows=3), layer_idx=0)
    index = torch.tensor([2, 0])
    for cache in (room, reference):  # rows dropped, as BatchCache.select does
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
    selected = room.layers[0].keys
    before = selected.clone()
    for cache in (room, reference):
        cache.update(_block(5, 1, rows=2), _block(6, 1, rows=2), layer_idx=0)
    assert _same_as_transformers(room, reference)
    assert torch.equal(selected, before) and room.layers[0].keys.data_ptr() != selected.data_ptr()


def test_a_room_is_let_go_as_soon_as_its_entries_are_replaced_and_blocks_must_match_them():
    layer = RoomLayer()
    layer.update(_block(0, 3, rows=2), _block(9, 3, rows=2))
    assert layer._room is not None
    layer.keys = layer.keys[:1]  # rows narrowed by a slice: same start, other shape
    layer.values = layer.values[:1]
    assert layer._room is not None
    layer.update(_block(1, 1), _block(2, 1))  # copied into a room of one row
    assert layer.keys.shape == (1, 2, 4, 3) and layer._room[0].shape[0] == 1
    with pytest.raises(ValueError, match="cannot follow"):
        layer.update(_block(1, 1, rows=3), _block(2, 1, rows=3))
    layer.keys = None  # as a slab does once it has copied a part's entries: the room's memory goes now
    assert layer._room is None
    layer.reset()
    layer.update(_block(0, 2), _block(0, 2))
    assert layer._room is not None
    layer.reset()
    assert layer._room is None and not layer.is_initialized
