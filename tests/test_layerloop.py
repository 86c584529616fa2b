"""The compiled layer loop: one row's passes through the direct decoder's layers in one call, with its bits."""

import pytest
import torch
from tiny_models import tiny_model

from lookahead.backends.transformers import layerloop, rowkernel
from lookahead.backends.transformers.capability import check_direct_decoder
from lookahead.backends.transformers.decoder import DirectDecoder, _rotate
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.kvcache import GROWTH_MARGIN, BatchCache
from lookahead.backends.transformers.linears import packed_linears
from lookahead.backends.transformers.slab import SlabCache
from lookahead.drafting.tree import DraftTree

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(rowkernel.load() is None, reason="the row kernel is not built on this machine"),
]

LLAMA_SHAPED = ["llama", "qwen2", "mistral"]  # qwen2's q/k/v have biases


def _forward(model: torch.nn.Module) -> ModelForward:
    forward = ModelForward(model)
    forward.linears = packed_linears(model)
    check_direct_decoder(forward)
    return forward


@pytest.fixture
def calls(monkeypatch) -> list[bool]:
    """Per pass the direct decoder ran, whether the compiled loop took it."""
    taken: list[bool] = []
    original = layerloop.LayerLoop.__call__

    def counted(self, *args, **kwargs):
        hidden = original(self, *args, **kwargs)
        taken.append(hidden is not None)
        return hidden

    monkeypatch.setattr(layerloop.LayerLoop, "__call__", counted)
    return taken


def _steps(forward: ModelForward, steps: int) -> list[torch.Tensor]:
    """A prompt read, `steps` one-token steps (past the room a cache is made with), a draft tree, more steps."""
    prompt = [(7 * i + 3) % 97 for i in range(40)]
    tree = DraftTree([11, 12, 13, 14], [0, 0, 1, 3])
    with torch.inference_mode():
        cache = forward.new_cache()
        out = [forward(cache, prompt, 0)]
        for i in range(steps):
            out.append(forward(cache, [(5 * i + 1) % 97], len(prompt) + i, DraftTree()))
        out.append(forward(cache, [8, *tree.tokens], len(prompt) + steps, tree))
        cache.crop(-len(tree))  # the root and nothing of the tree kept
        out += [forward(cache, [9 + i], len(prompt) + steps + 1 + i, DraftTree()) for i in range(3)]
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", LLAMA_SHAPED)
def test_one_rows_steps_and_drafts_go_through_it_with_the_python_loops_bits(family, threads, calls):
    torch.set_num_threads(threads)
    forward = _forward(tiny_model(family))
    assert forward.decoder is not None and forward.decoder.loop is not None
    calls.clear()  # (the check at start ran passes too)
    steps = GROWTH_MARGIN + 2  # the room runs out once: that pass grows it in Python, the loop goes on after
    got = _steps(forward, steps)
    # in Python: the prompt (no room yet), the step that outgrew the room, and the draft where its queries attend
    # a group of heads as one (attention._by_group: a key/value head for each thread or more)
    by_group = forward.config.num_key_value_heads >= 2 * threads
    assert [i for i, taken in enumerate(calls) if not taken] == [0, GROWTH_MARGIN + 1, *([steps + 1] * by_group)]
    calls.clear()
    forward.decoder.loop = None
    want = _steps(forward, steps)
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def _packed(forward: ModelForward, blocks: list[list[int]], trees: list[DraftTree]) -> list[torch.Tensor]:
    """Three prompts read alone, then one packed pass of their blocks (decoding/slab.py)."""
    prompts = [[(7 * i + 3 * row) % 97 for i in range(20 + 9 * row)] for row in range(3)]
    with torch.inference_mode():
        caches = [forward.new_cache() for _ in prompts]
        for cache, prompt in zip(caches, prompts, strict=True):
            forward(cache, prompt, 0)
        slab = SlabCache.merge([BatchCache(c, [c.get_seq_length()], [row]) for row, c in enumerate(caches)])
        return list(forward.rows(slab.cache, blocks, trees, slab.lengths, True))


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", LLAMA_SHAPED)
def test_a_packed_batchs_pass_goes_through_it_with_the_python_loops_bits(family, threads, one_call, calls):
    """Drafting rows attended in one padded call or in calls of their own, groups of heads as one head or not."""
    torch.set_num_threads(threads)
    forward = _forward(tiny_model(family))
    forward.one_call = one_call
    tree, chain = DraftTree([11, 12, 13, 14], [0, 0, 1, 3]), DraftTree([21, 22], [0, 1])
    for blocks, trees in (
        ([[8, *tree.tokens], [9, *chain.tokens], [10]], [tree, chain, DraftTree()]),  # in calls of their own
        ([[8, 11], [9, 21], [10]], [DraftTree([11], [0]), DraftTree([21], [0]), DraftTree()]),  # one call pays
        ([[8], [9], [10]], [DraftTree()] * 3),  # roots only
    ):
        calls.clear()
        got = _packed(forward, blocks, trees)
        assert calls[-1], "the packed pass took the loop"
        forward.decoder.loop, loop = None, forward.decoder.loop
        want = _packed(forward, blocks, trees)
        forward.decoder.loop = loop
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


@pytest.mark.parametrize("change", ["in place", "replaced", "in its dictionary"])
def test_a_weight_changed_is_multiplied_as_changed(calls, change):
    model = tiny_model("llama")
    forward = _forward(model)
    before = _steps(forward, 2)
    layers = model.model.layers
    with torch.no_grad():
        if change == "in place":
            layers[0].self_attn.k_proj.weight.mul_(1.5)  # a joined weight: made again
            layers[1].mlp.down_proj.weight.mul_(0.5)  # read in place
        elif change == "in its dictionary":  # as accelerate's device placement writes parameters, past the module
            norm = layers[0].post_attention_layernorm
            norm._parameters["weight"] = torch.nn.Parameter(torch.full_like(norm.weight, 0.5))
        else:
            layers[1].mlp.down_proj.weight = torch.nn.Parameter(layers[1].mlp.down_proj.weight * 0.5)
            layers[0].post_attention_layernorm.weight = torch.nn.Parameter(
                torch.full_like(layers[0].post_attention_layernorm.weight, 0.5)
            )
    calls.clear()
    after = _steps(forward, 2)
    forward.decoder.loop = None
    want = _steps(forward, 2)
    assert calls[1] and calls[2] and not torch.equal(before[1], after[1])  # its one-token steps took the loop
    assert all(torch.equal(a, b) for a, b in zip(want, after, strict=True))


@pytest.mark.parametrize("features", [576, 960, 100, 8, 7, 5, 3, 18432])
def test_its_norm_has_torchs_bits(features):
    kernel, generator = rowkernel.load(), torch.Generator().manual_seed(features)
    for rows in (1, 3, 16):
        for scale in (1e-3, 1.0, 3e4):
            x = torch.randn(1, rows, features, generator=generator) * scale
            weight = torch.randn(features, generator=generator)
            assert torch.equal(kernel.rms_norm(x, weight, 1e-5), torch.rms_norm(x, (features,), weight, 1e-5))


@pytest.mark.parametrize(("heads", "tokens"), [(9, 1), (3, 5), (15, 64)])
def test_its_rotation_has_the_decoders_bits(heads, tokens):
    generator = torch.Generator().manual_seed(heads * tokens)
    qkv = torch.randn(1, tokens, heads * 64 * 2, generator=generator)  # the heads a slice of q/k/v's product
    x = qkv[..., : heads * 64].view(1, tokens, heads, 64).transpose(1, 2)
    cos, signed_sin = (torch.randn(1, 1, tokens, 64, generator=generator) for _ in range(2))
    want, got = _rotate(x, cos, signed_sin), rowkernel.load().rotate(x, cos, signed_sin)
    assert torch.equal(got, want)
    assert all(a == b for a, b, size in zip(got.stride(), want.stride(), want.shape, strict=True) if size > 1)


def test_it_is_left_out_where_its_calls_would_not_be_the_python_loops(monkeypatch):
    hooked = tiny_model("llama")
    hooked.model.layers[1].self_attn.o_proj.register_forward_hook(lambda module, args, out: None)
    assert DirectDecoder.of(hooked).loop is None  # the hook runs only if the layer is called from Python
    assert DirectDecoder.of(tiny_model("llama", num_key_value_heads=4)).loop is None  # no groups: another call
    assert DirectDecoder.of(tiny_model("llama", hidden_act="gelu")).loop is None
    swapped = tiny_model("llama")
    swapped.model.layers[0].mlp.act_fn = torch.nn.GELU()  # the config still says SiLU
    assert DirectDecoder.of(swapped).loop is None
    monkeypatch.setattr(rowkernel, "load", lambda: None)
    assert DirectDecoder.of(tiny_model("llama")).loop is None


def test_a_loop_that_rounds_otherwise_is_dropped_and_the_python_loop_kept(monkeypatch):
    original = layerloop.LayerLoop.__call__

    def off_by_a_bit(self, *args, **kwargs):
        hidden = original(self, *args, **kwargs)
        return None if hidden is None else hidden * (1 + 1e-6)

    monkeypatch.setattr(layerloop.LayerLoop, "__call__", off_by_a_bit)
    forward = _forward(tiny_model("qwen2", seed=3))
    assert forward.decoder is not None and forward.decoder.loop is None


def test_the_bundled_models_steps_go_through_it_with_the_python_loops_bits(default_model, calls):
    """(Its tokens against generate(): test_engine_default, whose packed engine runs it.)"""
    torch.set_num_threads(2)
    forward = _forward(default_model[0])
    assert forward.decoder.loop is not None
    calls.clear()
    got = _steps(forward, 8)
    assert calls.count(True) == 8 + 1 + 3
    forward.decoder.loop = None
    assert all(torch.equal(a, b) for a, b in zip(_steps(forward, 8), got, strict=True))
