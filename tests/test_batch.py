"""Batched decoding on tiny models of every family: each row equals the same request alone and `generate()`."""

import random

import pytest
import torch
from conftest import hf_greedy
from tiny_models import FAMILIES, tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.backends.transformers import backend
from lookahead.backends.transformers.verifier import PROMPT_PIECE

tiny = pytest.mark.usefixtures("one_thread")

# what batching falls back to, and why, where a family cannot verify rows of different lengths together
ONE_AT_A_TIME = {"gemma2": "sliding-window"}  # Gemma 2: eager attention (logit soft-capping), no packed batch
# families whose rows are padded to the widest, not packed (decoding/slab.py), and the warning that says so
PADDED = {"falcon": "padded to the widest, not packed", "bloom": None}  # BLOOM: chains only, 2-D masks


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    """Token runs of different lengths, repeated so that the trie has something to draft from."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 12))] * 3 for _ in range(count)]


def _engine(family: str, tokenizer, **settings) -> LookaheadEngine:
    config = LookaheadConfig(decoding_length=8, branch_length=4, policy="fixed", recycled=8)  # every kind of draft
    return LookaheadEngine(tiny_model(family, **settings), tokenizer, config)


@tiny
@pytest.mark.filterwarnings("ignore:.*tree drafts fall back")  # BLOOM's chain fallback: test_capability checks it
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_rows_equal_each_request_alone(family, tokenizer):
    engine = _engine(family, tokenizer)
    prompts = _prompts(5)
    lengths = [30, 9, 24, 17, 30]  # rows finish at different steps and leave; with max_batch 3 others join
    alone = [hf_greedy(engine.model, ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    warning = f"one at a time.*{ONE_AT_A_TIME[family]}" if family in ONE_AT_A_TIME else PADDED.get(family)
    if warning is not None:
        with pytest.warns(UserWarning, match=warning):
            outs = engine.generate_batch(prompts, lengths, max_batch=3)
    else:
        outs = engine.generate_batch(prompts, lengths, max_batch=3)
    assert [out.token_ids for out in outs] == alone
    layout = None if family in ONE_AT_A_TIME else "padded" if family in PADDED else "packed"
    assert engine.verifier.layout == layout
    assert sum(out.stats.draft_tokens for out in outs) > 0
    plain = engine.generate_batch(prompts, lengths, max_batch=4, use_lookahead=False)
    assert [out.token_ids for out in plain] == alone
    assert engine.trie.stats()["live_requests"] == 0


@tiny
@pytest.mark.parametrize("grouped", [True, False])
def test_rows_equal_each_request_alone_with_grouped_heads_attended_either_way(grouped, tokenizer, monkeypatch):
    """Which way a batch's blocks attend groups of query heads is measured per machine (kernels.groups_as_heads)."""
    monkeypatch.setattr(backend, "groups_as_heads", lambda *args: grouped)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # rows x key/value heads enough to group on any machine
    engine = _engine("qwen2", tokenizer)
    prompts = _prompts(4, seed=7)
    lengths = [20, 12, 26, 16]
    alone = [hf_greedy(engine.model, ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    outs = engine.generate_batch(prompts, lengths, max_batch=4)
    assert engine.backend.forward.groups_as_heads is grouped
    assert [out.token_ids for out in outs] == alone
    assert sum(out.stats.draft_tokens for out in outs) > 0


# sliding windows of 12 tokens: Gemma 3 with one layer of each kind, Mistral and Qwen2 with every layer sliding
SLIDING = {
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]},
    "mistral": {},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 0},
}


@tiny
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_rows_past_a_sliding_window_are_packed_and_equal_each_request_alone(family, tokenizer):
    """Sliding layers keep one length for all rows in transformers; in a slab rows keep their past, the masks slide."""
    # a smaller init range than the other tests': with it the window changes most outputs (at 0.2, none)
    engine = _engine(family, tokenizer, sliding_window=12, initializer_range=0.05, **SLIDING[family])
    prompts = _prompts(5, seed=4)  # 9 to 33 tokens: some rows start inside the window, some past it
    lengths = [24, 10, 30, 16, 24]
    alone = [hf_greedy(engine.model, ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    outs = engine.generate_batch(prompts, lengths, max_batch=3)
    assert [out.token_ids for out in outs] == alone
    assert engine.verifier.layout == "packed"
    assert sum(out.stats.draft_tokens for out in outs) > 0


@tiny
def test_a_batch_admits_in_arrival_order_and_rows_leave_when_done(tokenizer):
    engine = _engine("llama", tokenizer)
    prompts = _prompts(4, seed=3)
    generations = [engine.prepare(ids, n) for ids, n in zip(prompts, [5, 20, 12, 20], strict=True)]
    batch = engine.batch(2)
    for generation in generations:
        batch.add(generation)
    sizes = []
    while batch:
        batch.step()
        sizes.append((len(batch.running), len(batch.waiting)))
    assert sizes[0] == (2, 2), "the first two join first"
    assert max(running for running, _ in sizes) == 2 and (2, 0) in sizes, "a finished row makes room at once"
    for generation, ids, n in zip(generations, prompts, [5, 20, 12, 20], strict=True):
        assert generation.output().token_ids == hf_greedy(engine.model, ids, n)
        assert not engine.verifier.holds(generation) and generation.drafter is None


class _Recording:
    """The engine's drafting, recording what each step says of its rows' chances of ending last."""

    def __init__(self, drafting, generations) -> None:
        self.drafting = drafting
        self.generations = generations
        self.lasts: list[list[float] | None] = []

    def __getattr__(self, name: str):
        return getattr(self.drafting, name)

    def fit(self, trees, context, last=None):
        unfinished = sum(not generation.done for generation in self.generations)
        assert last is None or len(trees) == unfinished, "valued by their end only when every row still to end steps"
        self.lasts.append(last)
        return self.drafting.fit(trees, context, last)


@tiny
@pytest.mark.parametrize("closed", [False, True])
def test_a_closed_batch_values_rows_by_their_end_once_none_waits(tokenizer, closed):
    engine = _engine("llama", tokenizer)
    prompts = _prompts(4, seed=3)
    lengths = [4, 40, 40, 12]
    batch = engine.batch(3, closed=closed)
    batch.prefill_chunk = 8  # the last prompt joins over several rounds while two others step
    generations = [engine.prepare(ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    batch.drafting = recording = _Recording(batch.drafting, generations)
    for generation in generations:
        batch.add(generation)
    while batch:
        batch.step()
    for generation, ids, n in zip(generations, prompts, lengths, strict=True):
        assert generation.output().token_ids == hf_greedy(engine.model, ids, n)
    if not closed:
        assert recording.lasts and all(last is None for last in recording.lasts), "a stream of requests: tokens alike"
        return
    assert recording.lasts[0] is None, "while one waits, a row that ends makes room: every token counts"
    valued = [last for last in recording.lasts if last is not None]
    assert valued and all(len(last) in (2, 3) and sum(last) == pytest.approx(1.0) for last in valued)
    assert recording.lasts[-1] is None, "a row alone is not valued: it is the last"


@tiny
def test_a_long_prompt_is_read_in_chunks_while_the_running_rows_keep_stepping(tokenizer):
    engine = _engine("llama", tokenizer)
    short = _prompts(2, seed=9)
    long = _prompts(1, seed=11)[0] * 5  # over 100 tokens
    assert len(long) > 100
    batch = engine.batch(3)
    batch.prefill_chunk = 16  # a tiny model's chunk: the prompt takes several rounds
    running = [engine.prepare(ids, 200) for ids in short]
    for generation in running:
        batch.add(generation)
    batch.step()  # both short prompts read at once: nothing else was running
    joiner = engine.prepare(long, 20)
    batch.add(joiner)
    reads = []
    while joiner.prefilled < len(long):
        before = [g.stats.new_tokens for g in running]
        batch.step()
        reads.append(joiner.prefilled)
        assert all(g.stats.new_tokens > n for g, n in zip(running, before, strict=True)), "no stall"
    assert len(reads) == -(-len(long) // 16) and all(b - a <= 16 for a, b in zip([0, *reads], reads, strict=False))
    while batch:
        batch.step()
    for generation, ids, n in [(running[0], short[0], 200), (running[1], short[1], 200), (joiner, long, 20)]:
        assert generation.output().token_ids == hf_greedy(engine.model, ids, n)


@tiny
def test_in_bfloat16_a_prompt_joining_a_batch_is_read_in_the_passes_it_is_read_alone(tokenizer):
    """Its cache then has the bits it has alone, and every row, drafting token by token, equals its plain decoding."""
    config = LookaheadConfig(policy="fixed", linears="packed")  # packed: a batch's products are made in pieces
    engine = LookaheadEngine(tiny_model("llama").to(torch.bfloat16), tokenizer, config)
    assert engine.backend.forward.nodewise
    short = _prompts(2, seed=9)
    long = [token for ids in _prompts(16, seed=11) for token in ids]
    assert PROMPT_PIECE < len(long) < 2 * PROMPT_PIECE
    alone = [engine.generate(ids, 40, use_lookahead=False).token_ids for ids in [*short, long]]
    batch = engine.batch(3)
    batch.prefill_chunk = 40  # a budget that would end a read inside a piece
    running = [engine.prepare(ids, 40) for ids in short]
    for generation in running:
        batch.add(generation)
    batch.step()
    joiner = engine.prepare(long, 40)
    batch.add(joiner)
    reads = []
    while joiner.prefilled < len(long):
        batch.step()
        reads.append(joiner.prefilled)
    assert reads == [PROMPT_PIECE, len(long)]
    while batch:
        batch.step()
    assert [generation.output().token_ids for generation in [*running, joiner]] == alone


@tiny
def test_a_cancelled_row_leaves_and_the_others_stay_exact(tokenizer):
    engine = _engine("qwen2", tokenizer)
    prompts = _prompts(3, seed=5)
    generations = [engine.prepare(ids, 25) for ids in prompts]
    batch = engine.batch(3)
    for generation in generations:
        batch.add(generation)
    batch.step()
    batch.step()
    batch.cancel(generations[1])
    while batch:
        batch.step()
    assert not engine.verifier.holds(generations[1]) and not generations[1].done
    for number in (0, 2):
        assert generations[number].output().token_ids == hf_greedy(engine.model, prompts[number], 25)
    assert engine.trie.stats()["live_requests"] == 0


@tiny
def test_per_prompt_options_and_their_errors(tokenizer):
    engine = _engine("llama", tokenizer)
    prompts = _prompts(3, seed=7)
    outs = engine.generate_batch(prompts, [4, 6, 8], stop_token_ids=[None, [], [7]], seed=[1, 2, 3], do_sample=True)
    assert [len(out.token_ids) <= n for out, n in zip(outs, [4, 6, 8], strict=True)] == [True] * 3
    for out, ids, seed, n in zip(outs, prompts, [1, 2, 3], [4, 6, 8], strict=True):
        alone = engine.generate(ids, n, do_sample=True, seed=seed, stop_token_ids=[7] if n == 8 else None)
        assert out.token_ids == alone.token_ids, "a seeded row draws what it draws alone"
    with pytest.raises(ValueError, match="seed: 2 values for 3 prompts"):
        engine.generate_batch(prompts, 4, seed=[1, 2])
    with pytest.raises(ValueError, match="max_batch"):
        engine.generate_batch(prompts, 4, max_batch=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate_batch(prompts, [4, 0, 4])


@pytest.mark.slow
def test_real_prompts_in_batches_with_rows_joining_and_leaving_equal_generate(default_model, greedy_references):
    model, tokenizer = default_model
    chosen = list(greedy_references)  # 4 prompts of each set, the sets in turn
    ids = [greedy_references[key][0] for key in chosen]
    assert len(ids) == 16 and len({len(x) for x in ids}) > 8, "prompts of mixed lengths"
    lengths = [12 + 4 * (i % 4) for i in range(len(ids))]  # 12-24: rows end apart, others join
    want = [greedy_references[key][1][:n] for key, n in zip(chosen, lengths, strict=True)]  # greedy: prefixes
    adaptive = LookaheadEngine(model, tokenizer)  # the default, priced by batched steps: may send no drafts
    fixed = LookaheadEngine(model, tokenizer, LookaheadConfig(policy="fixed"))  # whole trees: wide padded blocks
    for engine, max_batch, count in ((adaptive, 8, 16), (fixed, 3, 8)):
        outs = engine.generate_batch(ids[:count], lengths[:count], max_batch=max_batch)
        assert len(outs) == count
        mismatched = [key for key, out, w in zip(chosen, outs, want, strict=False) if out.token_ids != w]
        assert mismatched == [], f"max_batch={max_batch}"
    assert adaptive.verifier.batched and adaptive.policy.cost.rows[-1] > 1
    assert sum(out.stats.draft_tokens for out in outs) > 0 and sum(out.stats.steps for out in outs) < sum(lengths[:8])
