"""Packed linear layers: what the model computes, re-packed when a weight changes, the model left as it was."""

import pytest
import torch
from tiny_models import named_tiny_llama, tiny_model

from lookahead import LookaheadEngine
from lookahead.backends.transformers import backend, kernels, rowkernel
from lookahead.backends.transformers.costs import ModelMeter
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.kernels import DRAFT_WIDTHS, packed_candidate, packed_from, packed_wins_from
from lookahead.backends.transformers.linears import (
    JOIN_ROWS,
    JoinedLinear,
    PackedLinears,
    packable,
    packable_dtypes,
    packed_as,
    packed_linears,
)
from lookahead.decoding.costs import cache_path, read_cache, write_cache
from lookahead.drafting.tree import DraftTree

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this torch has no oneDNN packed linear layers")

PROMPT = [(7 * i) % 5000 + 30 for i in range(60)]
BLOCK = [412, 1093, 77, 2048, 9, 3131]


def _logits(forward: ModelForward, block: list[int], one_at_a_time: bool, prompt: list[int] = PROMPT) -> torch.Tensor:
    """Logits of `block` after `prompt`: in one chain-masked pass, or one token a pass (plain decoding)."""
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, prompt, 0, last_only=True)
        if not one_at_a_time:
            chain = DraftTree(tokens=block[1:], parents=list(range(len(block) - 1)))
            return forward(cache, block, len(prompt), chain)
        return torch.cat([forward(cache, [token], len(prompt) + i) for i, token in enumerate(block)])


def test_packed_layers_compute_what_the_model_does_and_leave_it_as_it_was(model):
    forward = ModelForward(model)
    with torch.inference_mode():
        before = model(torch.tensor([PROMPT])).logits
    own = _logits(forward, BLOCK, one_at_a_time=False)
    forward.linears = PackedLinears(model)
    assert len(forward.linears) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    packed = _logits(forward, BLOCK, one_at_a_time=False)
    torch.testing.assert_close(packed, own, rtol=0, atol=1e-3)  # rounding of another summation order, no more
    assert torch.equal(packed.argmax(-1), own.argmax(-1))
    assert not any("forward" in vars(module) for module in model.modules()), "routed only within the pass"
    with torch.inference_mode():
        assert torch.equal(model(torch.tensor([PROMPT])).logits, before)


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN computes no bfloat16 on this CPU")
@pytest.mark.usefixtures("one_thread")
def test_bfloat16_layers_pack_where_the_cpu_computes_bfloat16():
    model = tiny_model("llama").to(torch.bfloat16)
    vocab = model.config.vocab_size
    prompt, block = [t % vocab for t in PROMPT], [t % vocab for t in BLOCK]
    forward = ModelForward(model)
    own = _logits(forward, block, False, prompt)
    forward.linears = PackedLinears(model)
    assert len(forward.linears) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    packed = _logits(forward, block, False, prompt)
    assert packed.dtype == torch.bfloat16
    scale = float(own.float().abs().max())  # another summation order: a bfloat16 rounding or two of the logits, no more
    torch.testing.assert_close(packed.float(), own.float(), rtol=0, atol=2**-6 * scale)
    assert torch.equal(packed.argmax(-1), own.argmax(-1))


@pytest.mark.usefixtures("one_thread")
def test_a_weight_changed_after_packing_is_packed_again():
    model = tiny_model("llama")
    forward = ModelForward(model)
    forward.linears = PackedLinears(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # in place, as an optimizer step or load_state_dict does
        layer = model.model.layers[0].mlp.down_proj
        layer.weight = torch.nn.Parameter(layer.weight * -1.0)  # replaced
    own = ModelForward(model)
    torch.testing.assert_close(_tiny_logits(forward), _tiny_logits(own), rtol=0, atol=1e-4)
    model.to(torch.float64)  # moved without a new version: each layer computes itself
    torch.testing.assert_close(_tiny_logits(forward), _tiny_logits(own), rtol=0, atol=0)


def _tiny_logits(forward: ModelForward) -> torch.Tensor:
    with torch.inference_mode():
        return forward(forward.new_cache(), [5, 9, 17, 33, 65], 0)


def test_only_plain_linear_layers_of_a_packable_dtype_on_the_cpu_are_packed():
    class Adapter(torch.nn.Linear):
        pass

    wrapped = torch.nn.Linear(8, 8)
    wrapped.forward = lambda x: x  # a library's own forward (offloading, adapters) is left alone
    assert packable(torch.nn.Linear(8, 8))
    assert packable(torch.nn.Linear(8, 8, dtype=torch.bfloat16)) == (torch.bfloat16 in packable_dtypes())
    assert not packable(torch.nn.Linear(8, 8, dtype=torch.float64))
    assert not packable(Adapter(8, 8))
    assert not packable(wrapped)
    with packed_as(None):
        pass


@pytest.mark.usefixtures("one_thread")
def _own(linears: PackedLinears, modules: tuple, x: torch.Tensor, most_rows: int | None = None) -> list:
    """Each layer's own packed product (what a joined product must equal bit for bit)."""
    return [linears.layers[module](module, x, most_rows) for module in modules]


def _joined(linears: PackedLinears, modules: tuple, x: torch.Tensor, most_rows: int | None = None) -> tuple:
    parts = linears.joined(modules, x, most_rows)
    if parts is None:
        pytest.skip("oneDNN rounds a joined product of these shapes otherwise on this CPU")
    return parts


@pytest.mark.usefixtures("one_thread")
def test_joined_layers_give_each_layers_own_bits_and_follow_a_changed_weight_bias_or_thread_count():
    model = tiny_model("qwen2")  # q/k/v with biases
    linears = PackedLinears(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.inference_mode():
        for modules in (qkv, gate_up):
            assert all(map(torch.equal, _joined(linears, modules, x), _own(linears, modules, x)))
    with torch.no_grad():
        mlp.up_proj.weight.mul_(-2.0)  # in place
        attention.k_proj.bias.add_(1.0)
        attention.v_proj.bias = torch.nn.Parameter(attention.v_proj.bias * 3)  # replaced
    with torch.inference_mode():
        for modules in (qkv, gate_up):  # packed again, each layer too
            assert all(map(torch.equal, _joined(linears, modules, x), _own(linears, modules, x)))
        wide = torch.randn(3, 4, model.config.hidden_size)
        assert all(map(torch.equal, _joined(linears, gate_up, wide, 5), _own(linears, gate_up, wide, 5)))
        before = linears._joined[gate_up]
        torch.set_num_threads(2)  # the kernel may change with the threads: checked and packed again
        _joined(linears, gate_up, x)
        assert linears._joined[gate_up] is not before


def test_layers_are_joined_only_where_packed_alike_and_keeping_their_bits(monkeypatch):
    model = tiny_model("llama")
    linears = PackedLinears(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    width = model.config.hidden_size
    with torch.inference_mode():
        assert linears.joined((mlp.gate_proj, mlp.up_proj), torch.randn(1, JOIN_ROWS + 1, width)) is None  # a prompt
        _joined(linears, (mlp.gate_proj, mlp.up_proj), torch.randn(1, 3 * JOIN_ROWS, width), JOIN_ROWS)
        attention.k_proj.bias = torch.nn.Parameter(torch.zeros(attention.k_proj.out_features))  # a bias on one only
        assert linears.joined((attention.q_proj, attention.k_proj), torch.randn(1, 2, width)) is None
        assert linears.joined((attention.q_proj, torch.nn.Linear(width, 4)), torch.randn(1, 2, width)) is None
        monkeypatch.setattr(JoinedLinear, "same_bits", lambda *args: False)  # a shape that rounds otherwise
        other = PackedLinears(model)
        assert other.joined((mlp.gate_proj, mlp.up_proj), torch.randn(1, 2, width)) is None


@pytest.mark.usefixtures("one_thread")
def test_auto_measures_once_and_keeps_its_verdict(monkeypatch, tmp_path):
    class Quiet:  # a verdict measured on a busy machine is not kept (the next test): this one was quiet
        def quiet(self) -> bool:
            return True

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "OthersLoad", Quiet)
    timed = []
    real = kernels.time_both
    monkeypatch.setattr(kernels, "time_both", lambda *args: timed.append(1) or real(*args))
    model = named_tiny_llama("tiny-llama-for-linears")
    first = _auto(model)
    second = _auto(model)  # another engine on the model: its packed layers remember
    again = _auto(named_tiny_llama("tiny-llama-for-linears"))  # a restart: the cache file
    assert timed == [1]
    assert first == second == again
    entries = read_cache(cache_path())
    [name] = [name for name in entries if "tiny-llama-for-linears|" in name]
    entries[name] = {"packed": True}  # what older code kept: no width
    write_cache(cache_path(), entries)
    _auto(named_tiny_llama("tiny-llama-for-linears"))
    assert timed == [1, 1], "an entry without a width it can use is measured again"
    forward = ModelForward(model)
    assert packed_candidate(forward, "model") is None
    packed = packed_candidate(forward, "packed")
    assert len(packed) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert packed_candidate(ModelForward(model), "auto") is packed, "engines on one model share one packed copy"
    with packed_as(packed):  # another engine starting while this one's pass runs
        assert packed_candidate(ModelForward(model), "auto") is packed
    model.to(torch.float64)
    assert packed_candidate(ModelForward(model), "packed") is None, "no layer of a float64 model is packed"
    with pytest.raises(ValueError, match="linears must be one of"):
        packed_candidate(forward, "fast")


def _auto(model: torch.nn.Module) -> int | None:
    forward = ModelForward(model)
    return packed_from(forward, packed_candidate(forward, "auto"), DRAFT_WIDTHS)


def test_passes_run_packed_from_the_narrowest_width_they_win_at_and_every_wider_one():
    model = {1: 20.0, 2: 21.0, 4: 33.0, 8: 41.0}
    assert packed_wins_from({1: 26.0, 2: 27.0, 4: 27.5, 8: 30.0}, model) == 4
    assert packed_wins_from({1: 19.0, 2: 20.0, 4: 27.5, 8: 30.0}, model) == 1
    assert packed_wins_from({1: 19.0, 2: 22.0, 4: 27.5, 8: 30.0}, model) == 4, "a width it loses at comes first"
    assert packed_wins_from({1: 19.0, 2: 20.0, 4: 27.5, 8: 42.0}, model) is None, "it loses the widest"


@pytest.mark.usefixtures("one_thread")
def test_a_pass_narrower_than_packed_from_runs_the_models_own_layers():
    model = named_tiny_llama("tiny-llama-for-routing")
    forward = ModelForward(model)
    forward.linears, forward.packed_from = PackedLinears(model), 3
    routed = []
    real = forward.linears.forwards()
    spied = {m: (lambda x, f=f: routed.append(x.shape[-2]) or f(x)) for m, f in real.items()}
    forward.linears.forwards = lambda most_rows=None: spied
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, [5, 9, 17, 33], 0)  # prefill of 4 tokens: packed
        forward(cache, [65], 4)  # a plain step: the model's own
        forward(cache, [7, 8], 5, DraftTree([8], [0]))  # 2 tokens: the model's own
        forward(cache, [7, 8, 9], 7, DraftTree([8, 9], [0, 1]))  # 3 tokens: packed
        assert sorted(set(routed)) == [3, 4]
        routed.clear()
        rows = forward.new_cache()
        forward.rows(rows, [[5, 9], [17, 33]], [None, None], [0, 0], tree_masks=True)  # 2 rows of 2: 4 tokens
    assert routed and set(routed) == {2}, "a pass's tokens are every row's: packed"
    kind = forward.linears.kind  # 'rows' where the row kernel is built, else 'packed' (oneDNN)
    assert ModelMeter(forward).key.endswith(f"|linears={kind}-from-3"), "its passes are priced by curves of their own"


@pytest.mark.usefixtures("one_thread")
def test_a_verdict_measured_on_a_busy_machine_is_not_kept_for_the_next_start(monkeypatch, tmp_path):
    class Busy:
        def quiet(self) -> bool:
            return False

    monkeypatch.setenv("LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "OthersLoad", Busy)
    timed = []
    real = kernels.time_both
    monkeypatch.setattr(kernels, "time_both", lambda *args: timed.append(1) or real(*args))
    _auto(named_tiny_llama("tiny-llama-for-linears-busy"))
    _auto(named_tiny_llama("tiny-llama-for-linears-busy"))
    assert timed == [1, 1]


@pytest.mark.usefixtures("one_thread")
def test_packed_passes_are_priced_by_their_own_curves():
    model = named_tiny_llama("tiny-llama-for-linears-key")
    forward = ModelForward(model)
    unpacked = ModelMeter(forward).key
    forward.linears = PackedLinears(model)
    assert ModelMeter(forward).key == unpacked + f"|linears={forward.linears.kind}"


def test_products_wider_than_most_rows_are_made_in_pieces(monkeypatch):
    monkeypatch.setattr(rowkernel, "load", lambda: None)  # oneDNN's products (the row kernel's need no pieces)
    model = tiny_model("llama")
    linears = PackedLinears(model)
    layer = model.lm_head
    x = torch.randn(2, 9, layer.in_features)
    rows = []
    product = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *args: rows.append(x.numel() // x.shape[-1])
                        or product(x, *args))  # fmt: skip
    with torch.inference_mode():
        with packed_as(linears, most_rows=4):
            split = layer(x)
        assert rows == [4, 4, 4, 4, 2]  # 18 rows
        rows.clear()
        with packed_as(linears, most_rows=18):
            whole = layer(x)
        assert rows == [18]
    assert split.shape == whole.shape == (2, 9, layer.out_features)
    assert torch.allclose(split, whole, atol=1e-5)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="oneDNN computes no bfloat16 on this CPU")
@pytest.mark.filterwarnings("ignore:.*round bfloat16 otherwise")  # Gemma 3's fallback: test_capability checks it
@pytest.mark.parametrize(("family", "exact"), [("llama", True), ("gemma3_text", False)])
def test_bfloat16_runs_one_kind_of_layer_for_every_width_only_where_that_buys_bits(family, exact, monkeypatch):
    monkeypatch.setattr(backend, "packed_from", lambda *args: 4)  # packed layers measured faster from 4 tokens
    engine = LookaheadEngine(tiny_model(family).to(torch.bfloat16), None)
    forward = engine.backend.forward
    assert forward.nodewise == exact
    assert (forward.linears, forward.packed_from) == ((None, 1) if exact else (packed_linears(forward.model), 4))


def test_same_bits_finds_a_joined_product_that_rounds_otherwise(monkeypatch):
    model = tiny_model("llama")
    linears = PackedLinears(model)
    mlp = model.model.layers[0].mlp
    joined = JoinedLinear.of((mlp.gate_proj, mlp.up_proj), linears.rows)  # the kernel the layers run
    layers = [linears.layers[mlp.gate_proj], linears.layers[mlp.up_proj]]
    exact = joined.same_bits((mlp.gate_proj, mlp.up_proj), layers)
    product = JoinedLinear.__call__

    def off_at_seven_rows(self, x: torch.Tensor, most_rows: int | None) -> tuple[torch.Tensor, ...]:
        parts = product(self, x, most_rows)
        return tuple(part.nextafter(part + 1) if x.shape[0] == 7 else part for part in parts)

    monkeypatch.setattr(JoinedLinear, "__call__", off_at_seven_rows)
    assert not joined.same_bits((mlp.gate_proj, mlp.up_proj), layers)
    assert exact or linears.rows is False, "the row kernel sums each output alone: joined, it keeps the bits"
    assert exact or pytest.skip("oneDNN rounds this joined product otherwise on this CPU anyway")
