"""The capability probe: which drafts a model verifies exactly, and a warning whenever it falls back."""

import functools
import warnings

import pytest
import torch
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.backends.transformers import capability
from lookahead.backends.transformers.capability import probe_draft_mode, settle_rounding
from lookahead.backends.transformers.forward import ModelForward
from lookahead.drafting.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_thread")


def _patched(forward_of):
    """A tiny Llama whose forward is wrapped by `forward_of(original)`."""
    model = tiny_model("llama")
    model.forward = functools.wraps(model.forward)(forward_of(model.forward))  # keeps the keywords it takes
    return model


def test_a_model_that_takes_tree_masks_probes_as_tree_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe_draft_mode(ModelForward(tiny_model("llama"))) == "tree"


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gpt2", "gpt_neox", "opt", "falcon"])
def test_a_bfloat16_model_verifies_chains_node_by_node_with_the_bits_of_one_token_steps(family):
    forward = ModelForward(tiny_model(family).to(torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mode = probe_draft_mode(forward)
        assert settle_rounding(forward, mode, 20) == ("chain", 20)
    assert forward.nodewise
    prompt, block = [(5 * i + 2) % 97 for i in range(30)], [(3 * i + 1) % 97 for i in range(20)]
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, prompt, 0)
        steps = torch.cat([forward(cache, [token], len(prompt) + i) for i, token in enumerate(block)])
        cache.crop(-len(block))
        chain = forward(cache, block, len(prompt), DraftTree.chain(block[1:]))
        assert torch.equal(chain, steps)
        cache.crop(-len(block))
        forward.nodewise = False  # one attention call for the block: no longer the steps' computation
        assert not torch.equal(forward(cache, block, len(prompt), DraftTree.chain(block[1:])), steps)


def test_drafts_are_cut_to_the_widest_chain_verified_exactly_with_a_warning(monkeypatch):
    monkeypatch.setattr(capability, "_bit_exact_widths", lambda *args, **kwargs: (5, "node 0 of a chain of 6 differs"))
    with pytest.warns(UserWarning, match=r"drafts are cut to 4 tokens, the most verified exactly \(node 0 of"):
        engine = LookaheadEngine(tiny_model("llama").to(torch.bfloat16), None, LookaheadConfig(policy="fixed"))
    assert engine.config.decoding_length == engine.backend.max_draft == 4
    widths = _verified_widths(engine)
    prompt = [(7 * i) % 50 + 3 for i in range(40)] * 3
    assert engine.generate(prompt, 40).token_ids == engine.generate(prompt, 40, use_lookahead=False).token_ids
    assert 1 < max(widths) <= 5


def _verified_widths(engine: LookaheadEngine) -> list[int]:
    """Widths of the blocks the engine verifies from now on (prefills, which have no tree, not counted)."""
    widths: list[int] = []
    rows = engine.backend.forward.rows
    engine.backend.forward.rows = lambda cache, blocks, trees, *args, **kwargs: (
        widths.extend(len(block) for block, tree in zip(blocks, trees, strict=True) if tree is not None)
        or rows(cache, blocks, trees, *args, **kwargs)
    )
    return widths


def test_a_float32_model_keeps_its_trees_and_its_widest_block():
    forward = ModelForward(tiny_model("llama"))
    assert settle_rounding(forward, "tree", 33) == ("tree", 33)
    assert not forward.nodewise


def test_a_bfloat16_model_with_sliding_windows_keeps_trees_and_is_warned_why():
    forward = ModelForward(tiny_model("gemma3_text").to(torch.bfloat16))
    with pytest.warns(UserWarning, match=r"in bfloat16: .*\(node by node attention does not model sliding windows\)"):
        assert settle_rounding(forward, probe_draft_mode(forward), 33) == ("tree", 33)
    assert not forward.nodewise


def test_a_bfloat16_engine_drafts_chains_no_wider_than_verify_exactly():
    engine = LookaheadEngine(tiny_model("llama").to(torch.bfloat16), None, LookaheadConfig(policy="fixed"))
    assert engine.draft_mode == "chain" and not engine.tree_mode
    assert engine.config.decoding_length == engine.backend.max_draft == 32
    widths = _verified_widths(engine)
    prompt = [(7 * i) % 50 + 3 for i in range(40)] * 3
    plain = engine.generate(prompt, max_new_tokens=40, use_lookahead=False)
    fast = engine.generate(prompt, max_new_tokens=40)
    assert fast.token_ids == plain.token_ids
    assert fast.stats.draft_tokens > 0 and 1 < max(widths) <= 33


def _causal_only(forward, calls: list[int]):
    def run(*args, attention_mask=None, **kwargs):
        calls.append(1)
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None  # silently ignores the tree: every node sees every earlier block entry
        return forward(*args, attention_mask=attention_mask, **kwargs)

    return run


def test_a_model_that_misreads_the_tree_mask_falls_back_with_the_reason():
    model = _patched(functools.partial(_causal_only, calls=[]))
    with pytest.warns(UserWarning, match=r"fall back to single paths \(logits at draft node \d+ differ"):
        assert probe_draft_mode(ModelForward(model)) == "chain"


def test_drafts_are_checked_against_plain_decodings_steps_not_one_fresh_pass_over_the_path():
    """In bfloat16 on a CPU without bfloat16 instructions, reading a whole path in one fresh pass rounds otherwise
    than plain decoding's prompt pass and one-token steps (by several logits on SmolLM2); the probe must hold drafts to
    the steps, or it turns drafting off where drafts verify as plain decoding does."""

    def fresh_passes_round_otherwise(forward):
        def run(*args, input_ids=None, position_ids=None, **kwargs):
            out = forward(*args, input_ids=input_ids, position_ids=position_ids, **kwargs)
            fresh = position_ids is None or int(position_ids[0, 0]) == 0
            if fresh and input_ids.shape[1] > len(capability._PREFIX):
                out.logits[:, -1] += 1.0
            return out

        return run

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe_draft_mode(ModelForward(_patched(fresh_passes_round_otherwise))) == "tree"


def test_a_model_is_probed_once_and_every_engine_on_it_warns():
    calls: list[int] = []
    model = _patched(functools.partial(_causal_only, calls=calls))
    with pytest.warns(UserWarning, match="fall back to single paths"):
        first = LookaheadEngine(model, None, LookaheadConfig(policy="fixed"))
    probed = len(calls)
    with pytest.warns(UserWarning, match="fall back to single paths"):
        second = LookaheadEngine(model, None, LookaheadConfig(policy="fixed"))
    assert len(calls) == probed > 0, "the second engine ran no probe"
    assert first.draft_mode == second.draft_mode == "chain"
    model.to(torch.float64)  # what it computes with changed: probed again
    with pytest.warns(UserWarning, match="fall back to single paths"):
        LookaheadEngine(model, None, LookaheadConfig(policy="fixed"))
    assert len(calls) > probed


def test_a_model_that_fails_both_probes_turns_drafting_off_with_both_reasons(tokenizer):
    def one_token_at_a_time(forward):
        def run(*args, input_ids=None, **kwargs):
            if input_ids.shape[1] > 1 and kwargs.get("position_ids") is not None and kwargs["position_ids"][0, 0] > 0:
                raise RuntimeError("blocks after a cached prefix are not supported")
            return forward(*args, input_ids=input_ids, **kwargs)

        return run

    with pytest.warns(UserWarning, match="drafting is off.*not supported.*not supported"):
        engine = LookaheadEngine(_patched(one_token_at_a_time), tokenizer, LookaheadConfig(policy="fixed"))
    assert engine.draft_mode == "off"
    out = engine.generate([5, 6, 7, 8], max_new_tokens=6)
    assert out.stats.draft_tokens == 0 and out.stats.steps == out.stats.new_tokens - 1


def test_model_that_ignores_the_cache_is_refused(tokenizer):
    """A model that drops the cache it is given would decode garbage: refuse it at start."""

    def forgetful(forward):
        def run(*args, cache=None, past_key_values=None, **kwargs):
            return forward(*args, **kwargs)

        return run

    with pytest.raises(RuntimeError, match="does not continue from the cache"):
        LookaheadEngine(_patched(forgetful), tokenizer)


def test_packed_batches_are_probed_with_drafts_in_one_call_and_in_calls_of_their_own(monkeypatch):
    forward = ModelForward(tiny_model("llama"))
    seen, check = [], capability._rows_mismatch
    monkeypatch.setattr(capability, "_rows_mismatch", lambda f, *args: seen.append(f.one_call) or check(f, *args))
    assert capability._batch_mismatch(forward, DraftTree([5, 6, 7], [0, 0, 1]), "packed") is None
    assert seen == [True, False] and forward.one_call is True
