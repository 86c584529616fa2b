"""Sampling is lossless: proven exactly on a hand-made tree, and statistically through the engine."""

import math

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import tiny_model

import lookahead.backends.transformers.verifier
from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.decoding.sampling import OccurrencePenalty, SamplingParams, TokenChooser, argmaxes
from lookahead.decoding.verify import accept
from lookahead.drafting.tree import DraftTree

tiny = pytest.mark.usefixtures("one_thread")

VOCAB = 4
# root r; under it 0 and 1; 0 → 2 → 3; 1 → 1. Paths r-0-2-3, r-1-1.
TREE = DraftTree(tokens=[0, 1, 2, 1, 3], parents=[0, 0, 1, 2, 3])


def target(prefix: tuple[int, ...]) -> list[float]:
    """A fixed next-token distribution for every prefix (any positive numbers would do)."""
    weights = [1 + ((7 * sum(prefix) + 3 * len(prefix) + 5 * t) % 5) for t in range(VOCAB)]
    return [w / sum(weights) for w in weights]


class _NeedDraw(Exception):
    def __init__(self, path: list[int]) -> None:
        self.path = path


def outcome_distribution(verifier, tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Probability of every emitted sequence when each choice is a draw from `target`.

    Explores every sequence of draws: the verifier is rerun with a script of the draws so far
    and stops at the first draw not yet scripted, which then branches over all tokens.
    """
    result: dict[tuple[int, ...], float] = {}

    def explore(script: list[int], probability: float) -> None:
        calls = iter(script)

        def choose(node: int, path: list[int]) -> int:
            token = next(calls, None)
            if token is None:
                raise _NeedDraw(list(path))
            return token

        try:
            _, emitted = verifier(tree, choose)
        except _NeedDraw as need:
            for token, p in enumerate(target(tuple(need.path))):
                explore([*script, token], probability * p)
            return
        key = tuple(emitted)
        result[key] = result.get(key, 0.0) + probability

    explore([], 1.0)
    return result


def autoregressive(sequence: tuple[int, ...]) -> float:
    return math.prod(target(sequence[:i])[token] for i, token in enumerate(sequence))


def accept_every_draft(tree: DraftTree, choose):
    """A wrong verifier: follows the first branch whatever the model says, then draws a bonus token."""
    children = tree.children()
    node, accepted, emitted = 0, [], []
    while children[node]:
        node = next(iter(children[node].values()))
        accepted.append(node)
        emitted.append(tree.tokens[node - 1])
    emitted.append(choose(node, list(emitted)))
    return accepted, emitted


def test_sample_then_match_emits_exactly_the_target_distribution():
    outcomes = outcome_distribution(accept, TREE)
    assert math.isclose(sum(outcomes.values()), 1.0, abs_tol=1e-12)
    assert any(len(seq) == 4 for seq in outcomes), "the deepest path must be reachable"
    for sequence, probability in outcomes.items():
        assert math.isclose(probability, autoregressive(sequence), rel_tol=1e-9), sequence


def test_the_exact_check_catches_a_wrong_verifier():
    outcomes = outcome_distribution(accept_every_draft, TREE)
    assert any(not math.isclose(p, autoregressive(s), rel_tol=1e-3) for s, p in outcomes.items())


def test_chooser_draws_follow_the_processed_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=3)
    chooser = TokenChooser(params.processors(), True, seed=0)
    draws = [chooser.choose(logits, [1]) for _ in range(20_000)]
    counts = [draws.count(t) for t in range(5)]
    assert counts[3] == counts[4] == 0, "top_k=3 keeps three tokens"
    kept = torch.softmax(logits[:3].double() / 0.8, -1).tolist()
    assert chisquare(counts[:3], [p * len(draws) for p in kept]).pvalue > 1e-3


def test_greedy_with_repetition_penalty_sees_each_nodes_own_prefix():
    params = SamplingParams(repetition_penalty=2.0)
    chooser = TokenChooser(params.processors(), False, seed=None)
    logits = torch.tensor([1.0, 1.5, 0.2])
    assert chooser.choose(logits, [0]) == 1
    assert chooser.choose(logits, [1]) == 0  # 1.5 / 2 < 1.0


@pytest.mark.parametrize(
    ("option", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5), ("min_p", -0.1),
     ("repetition_penalty", 0.0), ("temperature", float("nan")), ("seed", "seven"), ("seed", 2**64),
     ("seed", -(2**63) - 1), ("seed", True), ("top_k", True), ("presence_penalty", 2.5),
     ("frequency_penalty", -3), ("presence_penalty", float("nan")), ("logit_bias", {5: 101}),
     ("logit_bias", {-1: 1.0}), ("logit_bias", {"5": 1.0})],
)  # fmt: skip
def test_bad_sampling_settings_name_the_argument(option, value):
    with pytest.raises(ValueError, match=option):
        SamplingParams(do_sample=True, **{option: value})


def test_presence_and_frequency_penalties_count_the_answer_only():
    """The worked example: prompt [5, 5], answer [5, 7, 5]; presence 0.5, frequency 0.25."""
    penalty = OccurrencePenalty(presence=0.5, frequency=0.25, prompt_length=2)
    scores = penalty(torch.tensor([[5, 5, 5, 7, 5]]), torch.zeros(1, 9))
    assert scores[0, 5] == -1.0 and scores[0, 7] == -0.75 and scores[0, [0, 1, 2, 3, 4, 6, 8]].eq(0).all()


def test_logit_bias_moves_the_choice_and_logprobs_are_the_raw_models():
    logits = torch.tensor([2.0, 1.0, 0.0])
    chooser = TokenChooser(SamplingParams(logit_bias={2: 5.0}).processors(), False, None, logprobs=2)
    assert chooser.choose(logits, [0]) == 2
    (record,) = chooser.chosen
    raw = torch.log_softmax(logits, -1)
    assert record.token == 2 and record.logprob == pytest.approx(float(raw[2]))
    assert [token for token, _ in record.top] == [0, 1] and record.top[0][1] == pytest.approx(float(raw[0]))


# ---- through the engine: a tiny model with a 16-token vocabulary --------------------------------

PROMPT = [3, 4, 5, 6, 7] * 3
DRAWS = 6_000
"""Draws of the law checked; a verifier that accepts every draft is caught with 2,000 (the test checks it is)."""
CONTROL_DRAWS = 4_000
"""Plain sampling's draws, the check of the test itself (the exact law and the goodness of fit)."""


@pytest.fixture(scope="module")
def tiny_engine():
    """One layer: tens of thousands of draws are all per-forward overhead, which grows with the layers."""
    model = tiny_model(
        "llama", vocab_size=16, eos_token_id=None, bos_token_id=None, pad_token_id=None, num_hidden_layers=1
    )
    model.generation_config.eos_token_id = None
    config = LookaheadConfig(decoding_length=8, branch_length=3, policy="fixed", recycled=4)  # every kind of draft
    engine = LookaheadEngine(model, None, config)
    assert engine.draft_mode == "tree"
    return engine


def exact_three_token_distribution(model, temperature: float) -> dict[tuple[int, ...], float]:
    """P(a, b, c | PROMPT) from the model's own forward passes, one prefix at a time."""
    probabilities: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(3):
            grown = {}
            for prefix, p in probabilities.items():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
                step = torch.softmax(logits / temperature, -1).tolist()
                grown.update({(*prefix, t): p * q for t, q in enumerate(step)})
            probabilities = grown
    return probabilities


def goodness_of_fit(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of the samples against the exact law, rare sequences pooled into one cell."""
    count = len(samples)
    common = sorted(seq for seq, p in exact.items() if p * count >= 5)
    observed = dict.fromkeys(common, 0)
    rest = 0
    for seq in samples:
        if seq in observed:
            observed[seq] += 1
        else:
            rest += 1
    expected = [exact[seq] * count for seq in common] + [count - sum(exact[seq] * count for seq in common)]
    return chisquare([*observed.values(), rest], expected).pvalue


def draw(engine, seeds, use_lookahead=True) -> tuple[list[tuple[int, ...]], int]:
    samples, accepted = [], 0
    for seed in seeds:
        out = engine.generate(PROMPT, 3, use_lookahead, do_sample=True, temperature=0.9, seed=seed)
        samples.append(tuple(out.token_ids))
        accepted += sum(n * steps for n, steps in out.stats.accepted_histogram.items())
    return samples, accepted


@pytest.mark.slow
@tiny
def test_lookahead_sampling_matches_the_models_distribution(tiny_engine, monkeypatch):
    exact = exact_three_token_distribution(tiny_engine.model, 0.9)
    draw(tiny_engine, range(10**6, 10**6 + 300))  # warm the trie so that drafts are offered
    samples, accepted = draw(tiny_engine, range(DRAWS))
    assert accepted > DRAWS // 10, "drafts were rarely accepted: the test would not exercise verification"
    assert goodness_of_fit(samples, exact) > 1e-3
    seeds = list(range(DRAWS, DRAWS + CONTROL_DRAWS))  # the test's own check, drawn quicker as plain batched decoding
    plain = tiny_engine.generate_batch([PROMPT] * CONTROL_DRAWS, 3, 64, False, do_sample=True, temperature=0.9,
                                       seed=seeds)  # fmt: skip
    assert goodness_of_fit([tuple(out.token_ids) for out in plain], exact) > 1e-3

    monkeypatch.setattr(lookahead.backends.transformers.verifier, "accept", accept_every_draft)
    wrong, _ = draw(tiny_engine, range(2 * DRAWS, 2 * DRAWS + 2_000))
    assert goodness_of_fit(wrong, exact) < 1e-3, "the test must catch a verifier that accepts every draft"


@tiny
def test_a_seed_gives_the_same_output_whatever_ran_before(tiny_engine):
    first = tiny_engine.generate(PROMPT, 12, do_sample=True, temperature=0.9, seed=7).token_ids
    for seed in range(20):  # the trie learns from these, so later drafts differ
        tiny_engine.generate(PROMPT, 12, do_sample=True, seed=seed)
    assert tiny_engine.generate(PROMPT, 12, do_sample=True, temperature=0.9, seed=7).token_ids == first
    assert tiny_engine.generate(PROMPT, 12, False, do_sample=True, temperature=0.9, seed=7).token_ids == first
    outputs = {tuple(tiny_engine.generate(PROMPT, 12, do_sample=True, seed=s).token_ids) for s in range(8)}
    assert len(outputs) > 1, "different seeds must be able to give different outputs"


@tiny
def test_a_negative_seed_is_its_twos_complement(tiny_engine):
    options = {"do_sample": True, "temperature": 0.9}
    negative = tiny_engine.generate(PROMPT, 12, seed=-1, **options).token_ids
    assert negative == tiny_engine.generate(PROMPT, 12, False, seed=2**64 - 1, **options).token_ids
    assert (
        tiny_engine.generate(PROMPT, 12, seed=-(2**63), **options).token_ids
        == tiny_engine.generate(PROMPT, 12, False, seed=2**63, **options).token_ids
    )


@tiny
def test_temperature_zero_is_greedy(tiny_engine):
    greedy = tiny_engine.generate(PROMPT, 10, use_lookahead=False).token_ids
    assert tiny_engine.generate(PROMPT, 10, do_sample=True, temperature=0.0, seed=3).token_ids == greedy


@pytest.mark.slow
@tiny
def test_sampled_rows_batched_with_other_rows_keep_the_models_distribution(tiny_engine):
    exact = exact_three_token_distribution(tiny_engine.model, 0.9)
    count = 3_000
    filler = [9, 10, 11, 12] * 4
    prompts = [PROMPT if i % 2 == 0 else filler for i in range(2 * count)]
    outs = tiny_engine.generate_batch(
        prompts, 3, max_batch=8, do_sample=True, temperature=0.9, seed=list(range(10**7, 10**7 + 2 * count))
    )
    samples = [tuple(out.token_ids) for out, prompt in zip(outs, prompts, strict=True) if prompt is PROMPT]
    accepted = sum(n * s for out in outs for n, s in out.stats.accepted_histogram.items())
    assert accepted > count // 10, "drafts must have been accepted in the batch"
    assert goodness_of_fit(samples, exact) > 1e-3
    alone = tiny_engine.generate(PROMPT, 3, do_sample=True, temperature=0.9, seed=10**7).token_ids
    assert list(samples[0]) == alone, "a seeded row draws what it draws alone"


# ---- OpenAI's penalties, logit bias and log-probabilities on the bundled model ---------------------


ANSWER = 32
"""New tokens a chat answer takes in the tests below: the second time it is asked, long drafts of it are verified."""


@pytest.fixture(scope="module")
def chats(default_model):
    engine = LookaheadEngine(*default_model)
    questions = ["Write a Python function that returns the squares of a list, then explain it.",
                 "List the days of the week, one per line, twice."]  # fmt: skip
    return [engine.chat_ids([{"role": "user", "content": q}]) for q in questions]


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampling"])
def test_penalties_and_logit_bias_keep_lookahead_exact(default_model, chats, sampled):
    engine = LookaheadEngine(*default_model)
    bias = {int(engine.encode(" the")[0]): -4.0, int(engine.encode(" list")[0]): 3.0}
    options = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "logit_bias": bias}
    if sampled:
        options |= {"do_sample": True, "temperature": 0.8, "seed": -12345}
    accepted, plains = 0, []
    for ids in chats:
        plains.append(plain := engine.generate(ids, ANSWER, use_lookahead=False, **options).token_ids)
        for _ in range(2):  # the second time, the trie holds this answer: long drafts are checked too
            out = engine.generate(ids, ANSWER, **options)
            assert out.token_ids == plain
            accepted += sum(n * steps for n, steps in out.stats.accepted_histogram.items())
    unpenalized = {k: v for k, v in options.items() if k not in ("presence_penalty", "frequency_penalty")}
    assert [engine.generate(ids, ANSWER, False, **unpenalized).token_ids for ids in chats] != plains, "penalties act"
    rows = engine.generate_batch(chats, ANSWER, max_batch=2, progress=False, **options)
    assert [row.token_ids for row in rows] == plains, "batched rows draw and penalize as they do alone"
    assert accepted > 20, "drafts were accepted, so verification ran with the penalties"


@pytest.mark.slow
def test_logprobs_are_what_plain_decoding_computes(default_model, chats):
    """Greedy lookahead's log-probabilities against transformers' own generate(output_logits=True)."""
    model, tokenizer = default_model
    engine = LookaheadEngine(model, tokenizer)
    for ids in chats:
        engine.generate(ids, ANSWER)  # the answer is in the trie: the next run verifies long drafts
        out = engine.generate(ids, ANSWER, logprobs=3)
        assert sum(n * steps for n, steps in out.stats.accepted_histogram.items()) > 10
        inputs = torch.tensor([ids])
        reference = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                   max_new_tokens=ANSWER, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        assert out.token_ids == reference.sequences[0, len(ids) :].tolist()
        assert len(out.logprobs) == len(out.token_ids)
        for record, logits in zip(out.logprobs, reference.logits, strict=True):
            want = torch.log_softmax(logits[0].float(), -1)
            assert record.logprob == pytest.approx(float(want[record.token]), abs=1e-4)
            values, top = want.topk(3)
            assert [token for token, _ in record.top] == top.tolist()
            assert [value for _, value in record.top] == pytest.approx(values.tolist(), abs=1e-4)
    sampled = {"do_sample": True, "temperature": 0.7, "seed": 3, "logprobs": 0}
    fast, plain = engine.generate(chats[0], 32, **sampled), engine.generate(chats[0], 32, False, **sampled)
    assert fast.token_ids == plain.token_ids and all(r.top == () for r in fast.logprobs)
    assert [r.logprob for r in fast.logprobs] == pytest.approx([r.logprob for r in plain.logprobs], abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmaxes_are_torch_argmax_first_largest_included(dtype):
    logits = torch.randn(5, 4099, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, 7] = logits[1, 4000] = logits[1].max() + 1  # a tie: the first one counts
    logits[2] = 0.0
    assert argmaxes(logits) == logits.argmax(-1).tolist()
    assert argmaxes(logits)[1:3] == [7, 0]
    assert argmaxes(logits[3]) == logits[3].argmax().item()
