"""Generation controls on the default model: stops, streaming, chat, bad input, sampled seeds."""

import pytest
import torch
from conftest import hf_greedy

from lookahead import LookaheadConfig, LookaheadEngine

pytestmark = pytest.mark.slow

CODE = "Write a Python function that checks whether a number is prime, with a docstring."


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return LookaheadEngine(model, tokenizer, LookaheadConfig(policy="fixed"))


def test_stop_string_cuts_the_text_and_the_trie_learns_only_what_was_kept(model, tokenizer):
    ids = LookaheadEngine(model, tokenizer).chat_ids([{"role": "user", "content": CODE}])
    full = LookaheadEngine(model, tokenizer).generate(ids, 80)
    stop = "def "
    assert stop in full.text, "the reply must contain the stop string for this test to mean anything"
    stopped_engine = LookaheadEngine(model, tokenizer)
    stopped = stopped_engine.generate(ids, 80, stop=[stop, "never appears"])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    same_tokens_engine = LookaheadEngine(model, tokenizer)
    same_tokens_engine.generate(ids, len(stopped.token_ids))
    assert len(stopped_engine.trie) == len(same_tokens_engine.trie), "tokens past a stop must not be learnt"


def test_stream_equals_generate_in_many_scripts(engine):
    for prompt in ["用中文写一句关于春天的话。", "Reply with three emoji and say why: 🎉🚀✨", CODE]:
        ids = engine.chat_ids([{"role": "user", "content": prompt}])
        stream = engine.stream(ids, 32)
        deltas = list(stream)
        text = "".join(deltas)
        assert stream.output is not None
        # only a reply cut by the token limit inside a character may end with a broken one
        assert not any("\ufffd" in delta for delta in deltas[:-1])
        assert "\ufffd" not in deltas[-1] or stream.output.finish_reason == "length"
        assert text == stream.output.text == engine.generate(ids, 32).text
        assert stream.output.token_ids == hf_greedy(engine.model, ids, 32)


def test_closing_a_stream_early_frees_the_engine(engine):
    ids = engine.chat_ids([{"role": "user", "content": CODE}])
    stream = engine.stream(ids, 64)
    next(stream)
    stream.close()
    assert stream.output is None
    assert engine.generate(ids, 16).token_ids == hf_greedy(engine.model, ids, 16)


def test_chat_applies_the_template(engine):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = engine.chat(messages, 24)
    assert out.token_ids == hf_greedy(engine.model, engine.chat_ids(messages), 24)


def test_repetition_penalty_matches_generate(engine):
    ids = engine.chat_ids([{"role": "user", "content": CODE}])
    with torch.inference_mode():
        want = engine.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=40, repetition_penalty=1.3, pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
    assert engine.generate(ids, 40, repetition_penalty=1.3).token_ids == want


def test_sampled_output_is_the_same_with_and_without_lookahead(engine):
    ids = engine.chat_ids([{"role": "user", "content": CODE}])
    options = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 11}
    fast = engine.generate(ids, 40, **options)
    assert fast.token_ids == engine.generate(ids, 40, use_lookahead=False, **options).token_ids
    assert fast.stats.steps < fast.stats.new_tokens, "drafts must have been accepted"


@pytest.mark.parametrize(
    ("options", "named"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
     ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": ""}, "stop"),
     ({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"max_new_tokens": 0}, "max_new_tokens")],
)  # fmt: skip
def test_bad_options_raise_before_any_step(engine, options, named):
    with pytest.raises(ValueError, match=named):
        engine.stream("hello", **{"max_new_tokens": 8, **options})


def test_unknown_option_is_a_type_error(engine):
    with pytest.raises(TypeError, match="temprature"):
        engine.generate("hello", 8, temprature=0.5)
