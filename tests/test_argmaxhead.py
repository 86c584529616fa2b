"""Greedy choices from bounded bfloat16 logits: always the whole float32 product's first largest logit."""

import pytest
import torch
from tiny_models import tiny_model

from lookahead.backends.transformers import argmaxhead, rowkernel
from lookahead.backends.transformers.capability import check_direct_decoder
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.linears import packed_linears
from lookahead.drafting.tree import DraftTree

pytestmark = pytest.mark.skipif(rowkernel.load() is None, reason="the row kernel is not built on this machine")


def _whole(hidden: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return rowkernel.load().linear(hidden, weight, None).numpy().argmax(-1).tolist()


def _head(features: int) -> argmaxhead.ArgmaxHead:
    return argmaxhead.ArgmaxHead(rowkernel.load(), features)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_it_chooses_the_whole_products_first_largest_logit(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(4096, 64, generator=generator)
    head = _head(64)
    with torch.inference_mode():
        for scale in (1e-3, 1.0, 1e3):
            hidden = torch.randn(rows, 64, generator=generator) * scale
            assert head._choose(hidden, weight).tolist() == _whole(hidden, weight)


def test_ties_and_near_ties_go_as_in_the_whole_product():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 64, generator=generator)
    hidden = torch.randn(8, 64, generator=generator)
    best = rowkernel.load().linear(hidden, weight, None).argmax(-1)
    for row, token in enumerate(best.tolist()):  # a copy of each row's winner later on: an exact tie, the first wins
        weight[1000 + row] = weight[token]
    for row, token in enumerate(best.tolist()):  # and one a rounding away, earlier on: bfloat16 cannot tell them apart
        weight[10 + row] = weight[token] * (1 + 2**-20)
    with torch.inference_mode():
        assert _head(64)._choose(hidden, weight).tolist() == _whole(hidden, weight)


def test_values_it_cannot_bound_leave_the_choice_to_the_whole_product():
    weight = torch.randn(512, 64)
    hidden = torch.randn(2, 64)
    hidden[1, 3] = float("inf")
    with torch.inference_mode():
        assert _head(64)._choose(hidden, weight) is None
        assert argmaxhead.ArgmaxHead(rowkernel.load(), 64)._choose(hidden[:1], weight) is not None


def test_its_copies_follow_a_weight_changed_in_place():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1024, 64, generator=generator)
    hidden = torch.randn(4, 64, generator=generator)
    head = _head(64)
    with torch.inference_mode():
        head._choose(hidden, weight)
    with torch.no_grad():
        weight[:512] *= -3.0
    with torch.inference_mode():
        assert head._choose(hidden, weight).tolist() == _whole(hidden, weight)


def test_a_weight_in_the_place_of_a_freed_one_gets_copies_of_its_own():
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(16, 64, generator=generator)
    head = _head(64)
    first = torch.randn(1024, 64, generator=generator)
    with torch.inference_mode():
        head._choose(hidden, first)
    del first  # its successor may take its identity, address and version
    second = torch.randn(1024, 64, generator=generator)
    with torch.inference_mode():
        assert head._choose(hidden, second).tolist() == _whole(hidden, second)


def test_values_flushed_to_zero_are_within_the_bound():
    weight = torch.zeros(512, 64)
    weight[7] = 1e-38  # subnormal products: bfloat16 instructions flush them, the float32 logit keeps them
    weight[300, 0] = 1.2e-38
    hidden = torch.full((4, 64), 100.0)  # (every token then within reach: 2,048 made exactly)
    with torch.inference_mode():
        assert _head(64)._choose(hidden, weight).tolist() == _whole(hidden, weight) == [7] * 4


def test_weights_it_cannot_bound_leave_the_choice_to_the_whole_product():
    weight = torch.randn(512, 64)
    weight[0] = 3e38  # its length overflows a float
    with torch.inference_mode():
        assert _head(64)._choose(torch.zeros(2, 64), weight) is None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_greedy_pass_chooses_what_its_logits_would(monkeypatch, family):
    monkeypatch.setattr(argmaxhead, "SWITCH_ROWS", (1,))  # at any width, on any machine
    monkeypatch.setattr(argmaxhead.ArgmaxHead, "_timed_start", lambda self, weight: 1)
    model = tiny_model(family)
    forward = ModelForward(model)
    forward.linears = packed_linears(model)
    check_direct_decoder(forward)
    assert forward.decoder is not None and forward.decoder.argmax_head is not None
    prompt = [(7 * i + 3) % 97 for i in range(30)]
    tree = DraftTree([11, 12, 13, 14], [0, 0, 1, 3])
    chosen = []
    original = argmaxhead.ArgmaxHead._choose
    monkeypatch.setattr(argmaxhead.ArgmaxHead, "_choose", lambda *args: chosen.append(1) or original(*args))
    with torch.inference_mode():
        passes = []
        for greedy in (False, True):
            cache = forward.new_cache()
            forward(cache, prompt, 0)
            passes.append(forward.rows(cache, [[8, *tree.tokens]], [tree], [len(prompt)], True, greedy=greedy)[0])
    logits, choices = passes
    assert chosen and choices.tolist() == logits.numpy().argmax(-1).tolist()
