"""model.generate(custom_generate=lookahead.hf.generate) returns what generate() returns, faster."""

import pytest
import torch
from transformers import TextIteratorStreamer

import lookahead.hf
from lookahead import LookaheadEngine

pytestmark = pytest.mark.slow

PROMPT = "Rewrite this loop as a list comprehension: for x in xs:\n    if x > 0:\n        out.append(x * 2)"


@pytest.fixture(scope="module")
def inputs(model, tokenizer):
    ids = LookaheadEngine(model, tokenizer).chat_ids([{"role": "user", "content": PROMPT}])
    return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def test_greedy_hook_equals_generate(model, inputs):
    plain = model.generate(**inputs, do_sample=False, max_new_tokens=48)
    hooked = model.generate(**inputs, do_sample=False, max_new_tokens=48, custom_generate=lookahead.hf.generate)
    assert hooked.tolist() == plain.tolist()
    engine = lookahead.hf.engine_for(model)
    assert engine.trie.stats()["shared_nodes"] > 0, "the per-model engine kept its trie"
    lookahead.hf.forget(model)
    assert (
        lookahead.hf.engine_for(model) is not engine
        and lookahead.hf.engine_for(model).trie.stats()["shared_nodes"] == 0
    )


def test_sampling_hook_equals_the_engine_with_the_same_seed(model, tokenizer, inputs):
    settings = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_new_tokens": 40}
    torch.manual_seed(5)
    hooked = model.generate(**inputs, custom_generate=lookahead.hf.generate, **settings)
    torch.manual_seed(5)
    seed = int(torch.randint(2**62, (1,)))
    ids = inputs["input_ids"][0].tolist()
    engine = LookaheadEngine(model, tokenizer)
    want = engine.generate(ids, 40, do_sample=True, temperature=0.7, top_p=0.9, top_k=50, seed=seed)
    assert hooked[0, len(ids) :].tolist() == want.token_ids


def test_streamer_receives_the_new_text(model, tokenizer, inputs):
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=32, custom_generate=lookahead.hf.streaming(streamer))
    streamed = "".join(streamer)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert streamed == tokenizer.decode(new, skip_special_tokens=True)


def test_return_dict_in_generate(model, inputs):
    out = model.generate(
        **inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
        custom_generate=lookahead.hf.generate,
    )  # fmt: skip
    plain = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.sequences.tolist() == plain.tolist()


def test_a_left_padded_batch_equals_generate(model, tokenizer):
    prompts = [PROMPT, "What is 2 + 2?", "Write a haiku about the sea, then explain it line by line."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]  # fmt: skip
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert not bool(batch["attention_mask"].all()), "the rows must differ in length for padding to matter"
    plain = model.generate(**batch, do_sample=False, max_new_tokens=40)
    hooked = model.generate(**batch, do_sample=False, max_new_tokens=40, custom_generate=lookahead.hf.generate)
    assert hooked.tolist() == plain.tolist()


def test_unsupported_inputs_are_refused(model, inputs):
    batch = {k: v.repeat(2, 1) for k, v in inputs.items()}
    batch["attention_mask"][0, -1] = (
        0  # right padding: generate() itself warns that it is wrong for decoder-only models
    )
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(**batch, max_new_tokens=4, custom_generate=lookahead.hf.generate)
