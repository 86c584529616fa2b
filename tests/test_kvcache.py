import torch
from transformers import DynamicCache

from lookahead.decoding.kvcache import keep_accepted


def _cache_with(values: list[float]) -> DynamicCache:
    cache = DynamicCache()
    states = torch.tensor(values).view(1, 1, -1, 1)
    cache.update(states.clone(), states.clone() * 10, layer_idx=0)
    return cache


def test_keeps_root_and_accepted_in_order_and_drops_the_rest():
    # 3 past entries, then a block of 5: root (100) and nodes 101..104
    cache = _cache_with([1, 2, 3, 100, 101, 102, 103, 104])
    keep_accepted(cache, block_size=5, accepted=[2, 4])
    layer = cache.layers[0]
    assert layer.keys.flatten().tolist() == [1, 2, 3, 100, 102, 104]
    assert layer.values.flatten().tolist() == [10, 20, 30, 1000, 1020, 1040]
    assert cache.get_seq_length() == 6


def test_prefix_acceptance_is_a_plain_cut():
    cache = _cache_with([1, 2, 100, 101, 102])
    keep_accepted(cache, block_size=3, accepted=[1])
    assert cache.layers[0].keys.flatten().tolist() == [1, 2, 100, 101]


def test_nothing_accepted_keeps_only_the_root():
    cache = _cache_with([1, 100, 101, 102])
    keep_accepted(cache, block_size=3, accepted=[])
    assert cache.layers[0].keys.flatten().tolist() == [1, 100]
