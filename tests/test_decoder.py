"""The direct decoder: a Llama-shaped model's layers as one loop, used only where it gives the model's own bits."""

import warnings

import pytest
import torch
from tiny_models import FAMILIES, tiny_model
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.backends.transformers import decoder
from lookahead.backends.transformers.capability import check_direct_decoder
from lookahead.backends.transformers.decoder import DirectDecoder
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.kvcache import BatchCache
from lookahead.backends.transformers.linears import packable_dtypes, packed_linears
from lookahead.backends.transformers.slab import SlabCache
from lookahead.drafting.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA_SHAPED = ["llama", "qwen2", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_only_llama_shaped_families_get_a_direct_decoder(family):
    assert (DirectDecoder.of(tiny_model(family)) is not None) == (family in LLAMA_SHAPED)


def test_a_sliding_window_keeps_the_models_forward():
    assert DirectDecoder.of(tiny_model("mistral", sliding_window=16)) is None


def _passes(forward: ModelForward) -> list[torch.Tensor]:
    """A prompt read, one-token steps, a draft tree, and a packed batch of two rows (one drafting a tree)."""
    prompts = [[(7 * i + 3) % 97 for i in range(40)], [(5 * i + 1) % 97 for i in range(23)]]
    tree = DraftTree([11, 12, 13, 14], [0, 0, 1, 3])
    with torch.inference_mode():
        caches = [forward.new_cache() for _ in prompts]
        out = [forward(cache, prompt, 0) for cache, prompt in zip(caches, prompts, strict=True)]
        out += [forward(caches[0], [token], len(prompts[0]) + i, DraftTree()) for i, token in enumerate([5, 6, 7])]
        out.append(forward(caches[0], [8, *tree.tokens], len(prompts[0]) + 3, tree))
        caches[0].crop(-5)  # back to the prompt and its three steps
        batch = SlabCache.merge(
            [BatchCache(cache, [cache.get_seq_length()], [row]) for row, cache in enumerate(caches)]
        )
        out += forward.rows(batch.cache, [[8, *tree.tokens], [9]], [tree, DraftTree()], batch.lengths, True)
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", LLAMA_SHAPED)
def test_the_direct_decoder_gives_the_models_logits_bit_for_bit(family, dtype, packed):
    forward = ModelForward(tiny_model(family).to(dtype))
    if packed:
        if dtype not in packable_dtypes():
            pytest.skip("oneDNN computes no bfloat16 on this CPU")
        forward.linears = packed_linears(forward.model)
    want = _passes(forward)
    check_direct_decoder(forward)
    assert forward.decoder is not None
    got = _passes(forward)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    if packed and any(forward.linears._same_bits.values()):  # (where this CPU rounds no joined shape alike, none)
        assert any(joined is not None for joined in forward.linears._joined.values()), "the passes ran joined"


class _ShiftedRMSNorm(LlamaRMSNorm):
    """Gemma's norm in Llama's clothes: scales by 1 + weight, which the loop would not."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + self.variance_epsilon) * (1.0 + self.weight)


def test_a_part_swapped_for_another_class_keeps_the_models_forward_and_its_tokens():
    model = tiny_model("llama")
    for layer in model.model.layers:
        norm = _ShiftedRMSNorm(model.config.hidden_size, eps=layer.input_layernorm.variance_epsilon)
        norm.weight.data.copy_(layer.input_layernorm.weight.data)
        layer.input_layernorm = norm
    engine = LookaheadEngine(model, None, LookaheadConfig(policy="fixed"))
    assert engine.backend.forward.decoder is None
    prompt = [(5 * i) % 60 + 2 for i in range(30)] * 2
    generated = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, pad_token_id=0)
    assert engine.generate(prompt, 30).token_ids == generated[0, len(prompt) :].tolist()


def test_a_loop_that_differs_in_any_bit_is_refused_at_start_and_said_so(monkeypatch):
    exact = decoder._rms_norm

    def one_step_up(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        normed = exact(norm, hidden)
        return torch.nextafter(normed, torch.full_like(normed, float("inf")))

    monkeypatch.setattr(decoder, "_rms_norm", one_step_up)
    forward = ModelForward(tiny_model("llama"))
    with pytest.warns(UserWarning, match=r"LlamaForCausalLM's layers run through its own forward, slower: .*\(pass 0"):
        check_direct_decoder(forward)
    assert forward.decoder is None


def test_hooks_or_a_replaced_forward_keep_the_models_forward():
    hooked = tiny_model("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, inputs, output: output * 2)
    patched = tiny_model("llama")
    patched.forward = patched.forward  # as wrappers that patch a model do
    assert DirectDecoder.of(tiny_model("llama")) is not None
    assert DirectDecoder.of(hooked) is None and DirectDecoder.of(patched) is None


def test_a_loop_that_gives_the_models_bits_is_used_without_a_word():
    forward = ModelForward(tiny_model("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_direct_decoder(forward)
    assert forward.decoder is not None


def test_the_switch_turns_the_loop_off():
    model = tiny_model("llama")
    assert LookaheadEngine(model, None, LookaheadConfig()).backend.forward.decoder is not None
    assert LookaheadEngine(model, None, LookaheadConfig(direct_layers=False)).backend.forward.decoder is None
    assert LookaheadConfig.parse("direct_layers=false").direct_layers is False


def test_a_hooked_linear_layer_is_called_as_a_module_and_its_hook_runs():
    model = tiny_model("llama")
    forward = ModelForward(model)
    check_direct_decoder(forward)
    plain = _passes(forward)
    model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda module, inputs, output: output * 2)
    hooked = ModelForward(model)
    check_direct_decoder(hooked)
    assert hooked.decoder is not None  # hooks on a linear layer leave the loop on, calling that layer as a module
    got = _passes(hooked)
    hooked.decoder = None
    assert all(torch.equal(a, b) for a, b in zip(got, _passes(hooked), strict=True))  # the model's own, hook and all
    assert not torch.equal(got[0], plain[0])


def test_a_patched_rotation_keeps_the_models_forward(monkeypatch):
    import transformers.models.llama.modeling_llama as modeling

    def fused(q, k, cos, sin, unsqueeze_dim=1):  # as a kernel library patching the family's rotation would
        return modeling.apply_rotary_pos_emb.__wrapped__(q, k, cos, sin, unsqueeze_dim)

    fused.__module__ = "a_kernel_library"
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", fused)
    assert DirectDecoder.of(tiny_model("llama")) is None


@pytest.mark.parametrize(
    ("ids", "mask", "implementation", "skipped"),
    [
        ((1, 1), None, "sdpa", True),
        ((1, 1), "ones", "lookahead_grouped_sdpa", True),
        ((1, 1), "padded", "sdpa", False),  # a hidden column: transformers builds a mask
        ((1, 1), "short", "sdpa", False),  # shorter than the keys: transformers pads it with hidden columns
        ((1, 1), "ones", "eager", False),  # eager attention takes a mask even for one token
        ((1, 2), "ones", "sdpa", False),
        ((2, 1), None, "sdpa", False),
    ],
)
def test_a_one_token_step_skips_building_a_mask_only_where_it_would_be_none(ids, mask, implementation, skipped):
    cache = DynamicCache(config=tiny_model("llama").config)
    cache.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), 0)
    masks = {
        None: None,
        "ones": torch.ones(1, 6),
        "padded": torch.tensor([[0, 1, 1, 1, 1, 1]]),
        "short": torch.ones(1, 4),
    }
    assert decoder._unmasked_step(torch.zeros(ids, dtype=torch.long), masks[mask], implementation, cache) is skipped
