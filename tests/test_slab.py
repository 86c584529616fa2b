"""SlabCache: rows joined from prefilled caches, packed blocks written at each row's cursor, kept, dropped, grown."""

import pytest
import torch
from conftest import hf_greedy
from tiny_models import tiny_model
from transformers import DynamicCache

from lookahead.backends.transformers import masks
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.kvcache import BatchCache
from lookahead.backends.transformers.masks import packed_inputs
from lookahead.backends.transformers.slab import GROWTH_MARGIN, SlabCache
from lookahead.drafting.tree import DraftTree


def _part(owner: str, *rows: list[float]) -> BatchCache:
    """A one-layer padded cache of `rows` (keys; values are keys * 10), padded with -1, owned by owner0, owner1, …"""
    width = max(map(len, rows))
    states = torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.float32)
    states = states.view(len(rows), 1, width, 1)
    cache = DynamicCache()
    cache.update(states.clone(), states.clone() * 10, layer_idx=0)
    return BatchCache(cache, [len(row) for row in rows], [f"{owner}{i}" for i in range(len(rows))])


def _rows(slab: SlabCache) -> list[list[float]]:
    keys, values = slab.layers[0].keys, slab.layers[0].values
    assert torch.equal(values, keys * 10), "values move with their keys"
    return [keys[row, 0, :length, 0].tolist() for row, length in enumerate(slab.lengths)]


def _write(slab: SlabCache, blocks: list[list[float]]) -> None:
    """What a packed forward pass does to the layer: every row's block written right after its entries."""
    slab.reserve([len(block) for block in blocks])
    slab.packing = packed_inputs(
        [[0] * len(b) for b in blocks], [None] * len(blocks), slab.lengths, torch.float32, "cpu"
    )[2]
    flat = torch.tensor([value for block in blocks for value in block], dtype=torch.float32).view(1, 1, -1, 1)
    slab.layers[0].update(flat, flat * 10)
    slab.packing = None


def test_merging_padded_parts_keeps_each_rows_entries_with_room_to_grow():
    slab = SlabCache.merge([_part("a", [1, 2, 3], [4]), _part("b", [5, 6])])
    assert _rows(slab) == [[1, 2, 3], [4], [5, 6]]
    assert slab.owners == ["a0", "a1", "b0"] and slab.past == 3
    assert slab.capacity == 3 + GROWTH_MARGIN
    assert slab.cache is slab, "the slab is itself the cache the model is given"


def test_blocks_are_written_at_each_rows_cursor_and_only_the_accepted_entries_kept():
    slab = SlabCache.merge([_part("a", [1, 2, 3], [4])])
    _write(slab, [[100, 101, 102], [200]])
    assert slab.layers[0].keys[0, 0, 3:6, 0].tolist() == [100, 101, 102]
    assert slab.layers[0].keys[1, 0, 1, 0].item() == 200, "right after the row's own entries, not at the longest row"
    slab.keep([[0, 2], [0]])
    assert _rows(slab) == [[1, 2, 3, 100, 102], [4, 200]]


def test_selecting_rows_drops_and_reorders_them():
    slab = SlabCache.merge([_part("a", [1, 2, 3], [4], [5, 6])])
    kept = slab.select(["a2", "a0"])
    assert _rows(kept) == [[5, 6], [1, 2, 3]] and kept.owners == ["a2", "a0"]
    assert kept.select(kept.owners) is kept
    left = SlabCache.merge([_part("b", [1, 2, 3], [4], [5, 6])])
    storage = left.layers[0].keys.data_ptr()
    remaining = left.select(["b0", "b2"])  # b1 left: the rows after it move up in place
    assert _rows(remaining) == [[1, 2, 3], [5, 6]] and remaining.owners == ["b0", "b2"]
    assert remaining.layers[0].keys.data_ptr() == storage, "a leave allocates nothing"
    assert SlabCache.merge([remaining]) is remaining, "nor does the merge of what is left"


def test_a_slab_merges_with_a_joining_row_and_grows_without_losing_entries():
    slab = SlabCache.merge([_part("a", [1, 2])])
    joined = SlabCache.merge([slab, _part("b", [7, 8, 9])])
    assert _rows(joined) == [[1, 2], [7, 8, 9]]
    long_block = [float(v) for v in range(joined.capacity)]
    _write(joined, [long_block, [10]])
    assert joined.capacity == 2 + len(long_block) + GROWTH_MARGIN, "grown by the margin, not doubled"
    joined.keep([list(range(len(long_block))), [0]])
    assert _rows(joined) == [[1, 2, *long_block], [7, 8, 9, 10]]


def test_a_row_joining_after_a_leave_is_copied_into_the_spare_row():
    slab = SlabCache.merge([_part("a", [1, 2, 3], [4], [5, 6])])
    storage = slab.layers[0].keys.data_ptr()
    slab = slab.select(["a0", "a2"])
    assert slab.layers[0].spare_rows == 1
    joined = SlabCache.merge([slab, _part("b", [7, 8])])
    assert joined is slab and joined.layers[0].keys.data_ptr() == storage, "no new slab: one row copied in"
    assert _rows(joined) == [[1, 2, 3], [5, 6], [7, 8]] and joined.owners == ["a0", "a2", "b0"]
    _write(joined, [[10], [11], [12]])
    joined.keep([[0], [0], [0]])
    assert _rows(joined) == [[1, 2, 3, 10], [5, 6, 11], [7, 8, 12]], "the joined row's stale columns were overwritten"


def test_joiners_that_do_not_fit_the_spare_rows_build_a_new_slab():
    slab = SlabCache.merge([_part("a", [1], [2])]).select(["a1"])
    two = SlabCache.merge([slab, _part("b", [3], [4])])  # two joiners, one spare row
    assert two is not slab and _rows(two) == [[2], [3], [4]]
    left = two.select(["a1", "b1"])
    long_row = [float(v) for v in range(left.capacity + 1)]
    wide = SlabCache.merge([left, _part("c", long_row)])  # longer than the slab's columns
    assert wide is not left and _rows(wide) == [[2], [4], long_row]
    spare = wide.select(["a1", "c0"])
    spare.reserve([spare.capacity, 1])
    assert spare.layers[0].spare_rows == 0, "growing keeps the rows in use only"
    assert _rows(spare) == [[2], long_row]


def test_new_columns_are_zero_so_masked_keys_stay_finite():
    slab = SlabCache.merge([_part("a", [1])])
    assert torch.count_nonzero(slab.layers[0].keys[0, 0, 1:]).item() == 0


def test_a_slab_refuses_the_writes_of_an_unpacked_forward():
    slab = SlabCache.merge([_part("a", [1])])
    with pytest.raises(RuntimeError, match="packed"):
        slab.layers[0].update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))


# Gemma 3 with a window of 8 and one layer of each kind: the rows (30, 5 and 20 tokens) are past the window
SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("one_call", [False, True], ids=["calls per row", "one call"])
@pytest.mark.parametrize(("family", "settings"), [("llama", {}), ("gpt2", {}), ("opt", {}), ("gemma3_text", SLIDING)])
def test_packed_rows_on_a_model_continue_exactly_as_each_row_alone(family, settings, one_call, monkeypatch):
    """Three rows (a tree, no draft, a chain) packed for two steps: each next token is greedy decoding's, whether
    the drafts attend in calls of their own or with every row's block in one padded call."""
    monkeypatch.setattr(masks, "_one_call_pays", lambda *_: one_call)
    made, make = [], masks._one_call
    monkeypatch.setattr(masks, "_one_call", lambda *args: made.append(1) or make(*args))
    model = tiny_model(family, **settings)
    forward = ModelForward(model)
    prompts = [list(range(10, 40)), list(range(50, 55)), list(range(60, 80))]
    with torch.inference_mode():
        parts = []
        for row, prompt in enumerate(prompts):
            cache = forward.new_cache()
            forward(cache, prompt, 0)
            parts.append(BatchCache(cache, [len(prompt)], [row]))
        slab = SlabCache.merge(parts)
        texts = [list(prompt) for prompt in prompts]
        for _ in range(2):
            greedy = [hf_greedy(model, text, 3) for text in texts]
            trees = [DraftTree(greedy[0][1:3], [0, 1]), DraftTree(), DraftTree(greedy[2][1:2], [0])]
            trees[0] = DraftTree([*trees[0].tokens, 7], [0, 1, 0])  # a branch that fails beside the right path
            blocks = [[greedy[row][0], *tree.tokens] for row, tree in enumerate(trees)]
            logits = forward.rows(slab, blocks, trees, slab.lengths, tree_masks=True)
            picks = [row.argmax(-1).tolist() for row in logits]
            for row, path in enumerate([[0, 1, 2], [0], [0, 1]]):  # the logits too: a window moves them, not the picks
                want = [forward(forward.new_cache(), texts[row] + greedy[row][: node + 1], 0)[-1] for node in path]
                torch.testing.assert_close(logits[row][path], torch.stack(want), rtol=1e-4, atol=1e-4)
            assert picks[0][:3] == [*greedy[0][1:3], hf_greedy(model, texts[0] + greedy[0][:3], 1)[0]]
            assert picks[1][0] == greedy[1][1]
            assert picks[2][:2] == greedy[2][1:3]
            slab.keep([[0, 1, 2], [0], [0, 1]])
            texts = [text + greedy[row][: [3, 1, 2][row]] for row, text in enumerate(texts)]
        assert slab.lengths == [len(text) for text in texts]
    assert bool(made) == (one_call and not settings), "one call where asked, except under a sliding window"


@pytest.mark.usefixtures("one_thread")
def test_a_sliding_layer_that_kept_only_its_window_is_refused():
    """The slab applies windows by masks over every row's full past; a layer that dropped entries cannot join."""
    model = tiny_model("gemma3_text", **SLIDING)
    forward = ModelForward(model)
    with torch.inference_mode():
        recorded = forward.new_cache()  # records the full past on sliding layers
        forward(recorded, list(range(10, 40)), 0)
        slab = SlabCache.merge([BatchCache(recorded, [30], ["a"])])
        assert slab.windows == [8, None] and slab.window == 8 and slab.sliding_layers == {0}
        dropped = DynamicCache(config=model.config)
        forward(dropped, list(range(10, 40)), 0)
        with pytest.raises(ValueError, match="full past"):
            SlabCache.merge([BatchCache(dropped, [30], ["b"])])


def test_a_slab_left_behind_is_freed_at_once():
    import gc
    import weakref

    slab = SlabCache.merge([_part("a", [1, 2])])
    joined = SlabCache.merge([slab, _part("b", [3])])
    left = weakref.ref(slab)
    gc.disable()
    try:
        del slab
        assert left() is None, "no reference cycle holds a slab's tensors until the collector runs"
    finally:
        gc.enable()
    assert _rows(joined) == [[1, 2], [3]]
