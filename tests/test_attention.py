"""Grouped-head attention for verification blocks: the same bits as transformers' SDPA, without its copy."""

import pytest
import torch
from tiny_models import named_tiny_llama, tiny_model

from lookahead import LookaheadEngine
from lookahead.backends.transformers import attention, kernels
from lookahead.backends.transformers.attention import GROUPED_SDPA, attention_as, grouped_attention
from lookahead.backends.transformers.forward import ModelForward
from lookahead.decoding.costs import cache_path, read_cache
from lookahead.drafting.tree import DraftTree

PAST = 40


def _block_logits(forward: ModelForward) -> torch.Tensor:
    """Two rows of different lengths, then a tree block on one and a chain on the other (both masked)."""
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[0, 0, 1, 2])
    chain = DraftTree(tokens=[9, 10, 11], parents=[0, 1, 2])
    with torch.inference_mode():
        cache = forward.new_cache()
        prompts = [[(3 * i) % 97 + 1 for i in range(PAST)], [(5 * i) % 89 + 1 for i in range(PAST - 7)] + [0] * 7]
        forward.rows(cache, prompts, [None, None], [0, 0], tree_masks=True, last_only=True)
        return forward.rows(cache, [[1, *tree.tokens], [2, *chain.tokens]], [tree, chain], [PAST, PAST - 7], True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_grouped_attention_gives_the_same_logits_bit_for_bit(family):
    model = tiny_model(family)
    forward = ModelForward(model)
    assert forward.attention == GROUPED_SDPA
    grouped = _block_logits(forward)
    forward.attention = None
    assert torch.equal(grouped, _block_logits(forward))


def test_masked_blocks_skip_transformers_sdpa_and_a_single_sequence_does_not(monkeypatch):
    forward = ModelForward(tiny_model("llama"))
    handed_over = []
    stock = attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        handed_over.append(query.shape[2])
        return stock(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counted)
    _block_logits(forward)
    assert handed_over == []  # rows of two lengths: every pass masked, every one grouped
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, [1, 2, 3], 0)  # causal, no mask needed: transformers' own grouped path
        forward(cache, [4], 3)  # one query without a mask: torch's SDPA directly, the call transformers makes
    assert handed_over == [3, 3]  # per layer


@pytest.mark.parametrize("head_dim", [64, 320])
def test_a_lone_query_gets_transformers_bits_and_wide_heads_go_to_transformers(monkeypatch, head_dim):
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    generator = torch.Generator().manual_seed(head_dim)
    query, key, value = (torch.randn(1, heads, length, head_dim, generator=generator) for heads, length in
                         ((6, 1), (2, 37), (2, 37)))  # fmt: skip
    want, _ = attention.sdpa_attention_forward(module, query, key, value, None, scaling=0.125)
    handed_over = []
    stock = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: handed_over.append(1) or stock(*a, **k))
    got, _ = attention.grouped_sdpa_forward(module, query, key, value, None, scaling=0.125)
    assert torch.equal(got, want)
    assert handed_over == ([] if head_dim <= 256 else [1])  # transformers packs groups otherwise for wider heads


def test_the_model_is_switched_for_the_pass_only():
    model = tiny_model("llama")
    seen = []
    model.model.layers[0].register_forward_hook(lambda *_: seen.append(model.config._attn_implementation))
    _block_logits(ModelForward(model))
    assert set(seen) == {GROUPED_SDPA}
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), attention_as(model, GROUPED_SDPA):
        raise RuntimeError("a failing pass")
    assert model.config._attn_implementation == "sdpa"


def test_only_sdpa_models_with_grouped_heads_on_a_cpu_switch():
    assert grouped_attention(tiny_model("llama"), torch.device("cpu")) == GROUPED_SDPA
    assert grouped_attention(tiny_model("llama"), torch.device("cuda")) is None  # there transformers' copy is faster
    assert grouped_attention(tiny_model("phi3"), torch.device("cpu")) is None  # as many key/value heads as queries
    assert grouped_attention(tiny_model("gpt2"), torch.device("cpu")) is None
    eager = tiny_model("llama", attn_implementation="eager")
    assert grouped_attention(eager, torch.device("cpu")) is None


def test_only_a_model_with_grouped_heads_read_in_place_may_attend_them_as_one():
    """Every other model attends head by head, and its one padded call is priced as such (masks.ONE_CALL_KEYS)."""
    assert ModelForward(tiny_model("llama")).groups_as_heads is True  # until measured slower (kernels.py)
    assert ModelForward(tiny_model("phi3")).groups_as_heads is False
    assert ModelForward(tiny_model("gpt2")).groups_as_heads is False


def _recorded_sdpa_calls(monkeypatch) -> list[tuple[int, bool]]:
    """(query heads, enable_gqa) of each call of torch's SDPA from here on, on two threads."""
    calls = []
    stock = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, *args, **kwargs):
        calls.append((query.shape[1], kwargs.get("enable_gqa", False)))
        return stock(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    return calls


@pytest.mark.parametrize("mask_heads", [1, 6])
@pytest.mark.parametrize("queries", [2, 3, 5])
def test_a_batch_block_attends_with_each_group_of_heads_as_one(monkeypatch, mask_heads, queries):
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(4, 6, queries, 16, generator=generator)
    key, value = (torch.randn(4, 2, 23, 16, generator=generator) for _ in range(2))
    mask = torch.randn(4, mask_heads, queries, 23, generator=generator)
    mask[..., 17:] = -torch.inf  # each query and head sees its own columns, with its own biases
    mask[1, :, 0, 3:] = -torch.inf
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=0.25, enable_gqa=True
    ).transpose(1, 2)
    calls = _recorded_sdpa_calls(monkeypatch)
    got = attention._torch_sdpa(module, query, key, value, mask, 0.0, 0.25)
    assert calls == [(2, False)]  # two key/value heads of three query heads each, one call, no copy of the cache
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference)  # the same sums, taken in another order


def test_one_row_or_one_query_keeps_the_head_by_head_call(monkeypatch):
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    calls = _recorded_sdpa_calls(monkeypatch)
    for rows, queries in ((1, 4), (8, 1)):  # one row: 2 key/value heads for 2 threads; one query: a plain step
        query, key, value = torch.randn(rows, 6, queries, 16), torch.randn(rows, 2, 9, 16), torch.randn(rows, 2, 9, 16)
        attention._torch_sdpa(module, query, key, value, None, 0.0, 0.25)
    assert calls == [(6, True), (6, True)]


def test_a_pass_said_head_by_head_keeps_the_head_by_head_call(monkeypatch):
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    calls = _recorded_sdpa_calls(monkeypatch)
    query, key, value = torch.randn(4, 6, 3, 16), torch.randn(4, 2, 9, 16), torch.randn(4, 2, 9, 16)
    with attention_as(tiny_model("llama"), None, groups_as_heads=False):  # measured slower here (kernels.py)
        attention._torch_sdpa(module, query, key, value, None, 0.0, 0.25)
    attention._torch_sdpa(module, query, key, value, None, 0.0, 0.25)  # the pass is over: grouped again
    assert calls == [(6, True), (2, False)]


@pytest.mark.usefixtures("one_thread")
def test_how_a_batch_attends_grouped_heads_is_measured_once_and_kept(monkeypatch, tmp_path):
    class Quiet:  # a verdict measured on a busy machine is not kept: this one was quiet
        def quiet(self) -> bool:
            return True

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "OthersLoad", Quiet)
    timed = []

    def head_by_head_faster(forward, layout, rows):
        timed.append((layout, rows))
        return {"group": {2: 11.0, 4: 14.0}, "head": {2: 10.0, 4: 14.5}}

    monkeypatch.setattr(kernels, "time_grouping", head_by_head_faster)
    model = named_tiny_llama("tiny-llama-for-grouping")
    engines = [LookaheadEngine(model, None), LookaheadEngine(model, None)]
    engines.append(LookaheadEngine(named_tiny_llama(model.config.name_or_path), None))
    for engine in engines:  # another engine on the model; a restart (the cache file)
        engine.batch(40)
        assert engine.backend.forward.groups_as_heads is False
        assert engine.backend.meter(batched=True).batch_key.endswith("|queries-by-head"), "curves of its own"
    assert timed == [("packed", kernels.GROUPING_MOST_ROWS)]
    [entry] = [entry for name, entry in read_cache(cache_path()).items() if "|groups-as-heads|" in name]
    assert entry["groups_as_heads"] is False and entry["ms"]["head"]["2"] == 10.0
    faster = named_tiny_llama("tiny-llama-for-grouping-2")
    monkeypatch.setattr(kernels, "time_grouping", lambda *args: {"group": {2: 9.0, 4: 9.0}, "head": {2: 9.5, 4: 9.5}})
    grouped = LookaheadEngine(faster, None)
    grouped.batch(4)
    assert grouped.backend.forward.groups_as_heads is True
    assert grouped.backend.meter(batched=True).batch_key.endswith("|queries-by-group")


@pytest.mark.usefixtures("one_thread")
def test_grouping_is_timed_on_real_batched_passes_both_ways():
    forward = ModelForward(tiny_model("llama"))
    times = kernels.time_grouping(forward, "packed", 3)
    assert set(times) == {"group", "head"}
    assert all(
        set(by_width) == set(kernels.GROUPING_WIDTHS) and min(by_width.values()) > 0 for by_width in times.values()
    )
    assert forward.groups_as_heads is True, "left as it was"
