"""Exactness on tiny random models of many architectures: tree mode where the model takes a
tree mask, the single-path fallback where it does not; both must equal `generate()`."""

import random

import pytest
from conftest import hf_greedy
from tiny_models import FAMILIES, tiny_model

from lookahead import LookaheadConfig, LookaheadEngine

pytestmark = pytest.mark.usefixtures("one_thread")

# Families known to honour a custom 4-D mask; the rest must be detected and fall back.
EXPECTED_MODE = {family: "tree" for family in FAMILIES} | {"bloom": "chain"}


def _prompts(count: int) -> list[list[int]]:
    """Random token runs repeated three times: the trie has something to draft from."""
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(12)] * 3 for _ in range(count)]


@pytest.mark.parametrize(("linears", "recycled"), [("packed", 8), ("model", 0)], ids=["packed-recycled", "model"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_greedy_on_family(family, linears, recycled, tokenizer):
    model = tiny_model(family)
    config = LookaheadConfig(decoding_length=12, branch_length=6, policy="fixed", linears=linears, recycled=recycled)
    if EXPECTED_MODE[family] == "tree":
        engine = LookaheadEngine(model, tokenizer, config)
    else:
        with pytest.warns(UserWarning, match="fall back to single paths"):
            engine = LookaheadEngine(model, tokenizer, config)
    assert engine.draft_mode == EXPECTED_MODE[family]
    accepted = 0
    for ids in _prompts(4):
        want = hf_greedy(model, ids, 40)
        out = engine.generate(ids, max_new_tokens=40)
        assert out.token_ids == want
        assert engine.generate(ids, max_new_tokens=40, use_lookahead=False).token_ids == want
        accepted += sum(n * steps for n, steps in out.stats.accepted_histogram.items())
    assert accepted > 0, "drafts were never accepted, so verification was not exercised"


def test_sliding_window_model_past_its_window(tokenizer):
    """Gemma 3 with a 16-token window: trees inside the window, single paths beyond it."""
    model = tiny_model("gemma3_text", sliding_window=16)
    engine = LookaheadEngine(model, tokenizer, LookaheadConfig(decoding_length=8, branch_length=4, policy="fixed"))
    for ids in _prompts(2):
        assert engine.generate(ids, max_new_tokens=30).token_ids == hf_greedy(model, ids, 30)


def test_warns_about_generation_settings_it_does_not_apply(tokenizer):
    model = tiny_model("llama")
    model.generation_config.repetition_penalty = 1.3
    with pytest.warns(UserWarning, match="repetition_penalty"):
        LookaheadEngine(model, tokenizer, LookaheadConfig(policy="fixed"))
