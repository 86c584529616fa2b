"""The step loop on its own: a list of generations stepped together, and a paused stream."""

import pytest
import torch
from conftest import hf_greedy
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.decoding.step import start, step

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 3, [40, 41, 42, 43] * 4, [100, 7, 100, 7, 100, 7]]


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # every generation runs to its own length
    return LookaheadEngine(model, tokenizer, LookaheadConfig(decoding_length=8, branch_length=4, policy="fixed"))


def test_generations_stepped_together_equal_each_alone(engine):
    lengths = [30, 12, 21]
    alone = [engine.generate(ids, n).token_ids for ids, n in zip(PROMPTS, lengths, strict=True)]
    generations = [engine.prepare(ids, n) for ids, n in zip(PROMPTS, lengths, strict=True)]
    for generation in generations:
        generation.drafter = engine.drafting.open(generation.prompt)
        engine.verifier.join(generation)
    start(generations, engine.verifier)
    while running := [g for g in generations if not g.done]:
        step(running, engine.verifier)  # the list shrinks as generations finish: rows leave at once
    for generation in generations:
        generation.drafter.close()
        engine.verifier.leave(generation)
    assert [g.output().token_ids for g in generations] == alone
    assert [g.stats.new_tokens for g in generations] == lengths
    assert any(g.stats.steps < g.stats.new_tokens - 1 for g in generations), "drafts must have been accepted"
    assert engine.trie.stats()["live_requests"] == 0


def test_a_paused_stream_leaves_the_caller_outside_inference_mode(engine):
    want = hf_greedy(engine.model, PROMPTS[0], 24)
    stream = engine.stream(PROMPTS[0], 24)
    chunks = 0
    for _ in stream:
        chunks += 1
        assert not torch.is_inference_mode_enabled()
        weight = torch.ones(2, requires_grad=True)
        (weight * 3).sum().backward()  # the caller can still train between chunks
        assert weight.grad.tolist() == [3.0, 3.0]
    assert chunks > 1 and stream.output.token_ids == want


def test_closing_a_stream_releases_its_drafter_and_cache(engine):
    generation = engine.prepare(PROMPTS[1], 40)
    steps = engine._steps(generation, use_lookahead=True)
    next(steps)
    assert engine.verifier.holds(generation) and engine.trie.stats()["live_requests"] == 1
    steps.close()
    assert not engine.verifier.holds(generation) and engine.trie.stats()["live_requests"] == 0
