"""Exactness on the bundled default model, real prompts from every benchmark set, warm trie; the linear layers
packed (the default on CPUs where that is faster) and the model's own; drafts recycled from the model's top tokens."""

import functools

import numpy as np
import pytest
from conftest import BENCHMARK_SETS, PROMPTS_PER_SET, REFERENCE_TOKENS, hf_greedy

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.bench.datasets import load_prompts
from lookahead.drafting.ngrams import RECYCLED

pytestmark = pytest.mark.slow


VARIANTS = {"packed": LookaheadConfig(linears="packed"), "model": LookaheadConfig(linears="model"),
            "recycled": LookaheadConfig(recycled=8, policy="fixed")}  # fmt: skip
"""The recycled variant sends its whole tree, so which recycled drafts are verified does not hang on measured costs."""
PROMPTS = {"packed": PROMPTS_PER_SET, "model": 2, "recycled": 3}
"""Prompts of each set a variant decodes: all for the default path; fewer where only the layers or one more
draft source differ (the model's own layers run at generate()'s speed, the suite's slowest path)."""


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engine(default_model, variant):
    return LookaheadEngine(*default_model, VARIANTS[variant])


@pytest.fixture(scope="module")
def reference(model):
    """The model's own greedy output, computed once for every variant."""

    @functools.cache
    def greedy(ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        return hf_greedy(model, list(ids), max_new_tokens)

    return greedy


def test_real_prompts_of_every_set_equal_generate(engine, variant, greedy_references, monkeypatch):
    """The sets in turn, so the shared trie carries what earlier answers taught into other kinds of text."""
    assert engine.tree_mode
    recycled = {"sent": 0, "kept": 0}  # nodes the table offered (retrieval may have too)
    learn = engine.policy.learn

    def count_recycled(tree, accepted, request):
        offered = (np.asarray(tree.sources, dtype=np.int64) & RECYCLED) != 0
        recycled["sent"] += int(offered.sum())
        recycled["kept"] += int(offered[np.asarray(accepted, dtype=np.int64) - 1].sum())
        learn(tree, accepted, request)

    monkeypatch.setattr(engine.policy, "learn", count_recycled)
    assert len(greedy_references) == len(BENCHMARK_SETS) * PROMPTS_PER_SET
    mismatches = []
    drafted = accepted = 0
    texts = {(p.dataset, p.key): p.text for p in load_prompts(BENCHMARK_SETS, PROMPTS_PER_SET)}
    chosen = list(greedy_references.items())[: len(BENCHMARK_SETS) * PROMPTS[variant]]  # the sets in turn
    for key, (ids, want) in chosen:
        assert engine.chat_ids([{"role": "user", "content": texts[key]}]) == ids
        out = engine.generate(ids, max_new_tokens=REFERENCE_TOKENS)
        if out.token_ids != want:
            mismatches.append(key)
        drafted += out.stats.draft_tokens
        accepted += out.stats.new_tokens - out.stats.steps - 1
    assert mismatches == []
    assert drafted > 0 and accepted > 0
    if engine.config.recycled:
        assert recycled["sent"] > 0 and recycled["kept"] > 0, recycled


def test_plain_path_equals_generate_and_leaves_the_trie_alone(engine, reference):
    prompt = load_prompts(["code-edit"], 1)[0]
    ids = engine.chat_ids([{"role": "user", "content": prompt.text}])
    before = engine.trie.stats()
    out = engine.generate(ids, max_new_tokens=32, use_lookahead=False)
    assert out.token_ids == reference(tuple(ids), 32)
    assert out.stats.draft_tokens == 0 and out.stats.steps == out.stats.new_tokens - 1
    assert engine.trie.stats() == before


def test_stream_equals_generate(engine):
    prompt = load_prompts(["mtbench"], 1)[0]
    ids = engine.chat_ids([{"role": "user", "content": prompt.text}])
    out = engine.generate(ids, max_new_tokens=48)
    assert "".join(engine.stream(ids, max_new_tokens=48)) == out.text
    assert out.stats.new_tokens == len(out.token_ids) == 48
    assert out.finish_reason == "length"


def test_stops_at_end_of_sequence(engine, reference):
    ids = engine.chat_ids([{"role": "user", "content": "Say just the word yes."}])
    out = engine.generate(ids, max_new_tokens=100)
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.eos_ids
    assert out.token_ids == reference(tuple(ids), 100)


def test_bad_arguments(engine):
    with pytest.raises(ValueError):
        engine.generate("hi", max_new_tokens=0)
    with pytest.raises(ValueError):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([1, 2, engine.model.config.vocab_size], max_new_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([-1, 5], max_new_tokens=4)
    with pytest.raises(ValueError, match="context"):
        engine.generate([1] * 10, max_new_tokens=10**6)


def test_bfloat16_lookahead_equals_its_own_plain_decoding_on_real_prompts(greedy_references):
    """bfloat16 rounds a wide pass otherwise than a one-token step; chains verified node by node do not, alone or
    in a batch."""
    from lookahead import load_model

    engine = LookaheadEngine(*load_model(dtype="bfloat16"))
    assert engine.draft_mode == "chain" and engine.backend.forward.nodewise
    prompts = [ids for ids, _ in list(greedy_references.values())[: len(BENCHMARK_SETS) * 2]]  # the sets in turn
    drafted = 0
    alone = []
    for index, ids in enumerate(prompts):
        options = {"temperature": 0.8, "seed": index} if index % 2 else {}
        plain = engine.generate(ids, max_new_tokens=48, use_lookahead=False, **options)
        fast = engine.generate(ids, max_new_tokens=48, **options)
        assert fast.token_ids == plain.token_ids, (index, options)
        drafted += fast.stats.draft_tokens
        alone.append(plain.token_ids)
    assert drafted > 0
    greedy = alone[::2]  # rows of one batch, every row with its own length, drafting or not: each as it is alone
    for use_lookahead in (False, True):
        rows = engine.generate_batch(prompts[::2], 48, max_batch=4, use_lookahead=use_lookahead)
        assert [row.token_ids for row in rows] == greedy, use_lookahead
    narrow = LookaheadEngine(engine.model, engine.tokenizer, LookaheadConfig(decoding_length=16))
    if narrow.backend.forward.linears is not None:
        assert narrow.backend.forward.most_rows <= 17  # a batch's products no wider than the chains checked
    else:  # oneDNN computes no bfloat16 on this CPU: the model's own layers, whose products cannot be split
        assert narrow.backend.forward.most_rows is None and engine.backend.verifier.layout is None  # rows one at a time
    assert [row.token_ids for row in narrow.generate_batch(prompts[::2], 48, max_batch=4)] == greedy
