"""The row kernel: what torch's linear computes, each row with its one-row bits at any width, used where it fits."""

import logging
import os
import time

import pytest
import torch
from tiny_models import tiny_model

from lookahead.backends.transformers import rowkernel
from lookahead.backends.transformers.forward import ModelForward
from lookahead.backends.transformers.linears import PackedLinears, packed_as

KERNEL = rowkernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no row kernel on this machine (CPU, compiler or switch)")


@needs_kernel
@pytest.mark.parametrize(("outputs", "features"), [(96, 64), (97, 70), (1, 16), (5, 3)])  # odd rows, k past the lanes
def test_each_row_gets_its_one_row_bits_at_any_width(outputs, features):
    generator = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, features, generator=generator)
    bias = torch.randn(outputs, generator=generator)
    x = torch.randn(40, features, generator=generator)  # passes of 6 (AVX-512) or 4 (AVX2) rows and a remainder
    with torch.inference_mode():
        alone = torch.cat([KERNEL.linear(x[i : i + 1], weight, bias) for i in range(len(x))])
        for rows in range(1, len(x) + 1):
            assert torch.equal(KERNEL.linear(x[:rows], weight, bias), alone[:rows]), f"{rows} rows"
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(KERNEL.linear(x, weight, None), x @ weight.T, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.usefixtures("one_thread")
def test_bits_do_not_depend_on_threads_or_the_inputs_layout():
    weight, x = torch.randn(300, 64), torch.randn(2, 3, 64)
    with torch.inference_mode():
        one = KERNEL.linear(x, weight, None)
        torch.set_num_threads(2)
        assert torch.equal(KERNEL.linear(x, weight, None), one)
        transposed = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
        assert torch.equal(KERNEL.linear(transposed, weight, None), one)
    assert one.shape == (2, 3, 300)


@needs_kernel
def test_what_it_refuses():
    with pytest.raises(RuntimeError, match="float32 only"):
        KERNEL.linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        KERNEL.linear(torch.randn(2, 8), torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match="do not match"):
        KERNEL.linear(torch.randn(2, 7), torch.randn(4, 8), None)


@needs_kernel
@pytest.mark.usefixtures("one_thread")
def test_packed_layers_run_it_up_to_its_widest_and_the_blas_beyond(monkeypatch):
    model = tiny_model("llama")
    linears = PackedLinears(model)
    assert linears.kind == f"rows-{rowkernel.fingerprint()}"
    layer = model.lm_head
    assert linears.layers[layer].packed.data_ptr() == layer.weight.data_ptr(), "the weight itself: no copy"
    rows = []
    kernel = rowkernel.load()

    class Spy:
        def linear(self, x, weight, bias):
            rows.append(x.numel() // x.shape[-1])
            return kernel.linear(x, weight, bias)

    monkeypatch.setattr(rowkernel, "load", lambda: Spy())
    with torch.inference_mode(), packed_as(linears):
        narrow = layer(torch.randn(1, rowkernel.MOST_ROWS, layer.in_features))
        wide = layer(torch.randn(1, rowkernel.MOST_ROWS + 1, layer.in_features))
    assert rows == [rowkernel.MOST_ROWS], "the wider product is the BLAS's"
    assert narrow.shape[1] + 1 == wide.shape[1]


@needs_kernel
def test_a_model_on_it_computes_what_the_model_does():
    model = tiny_model("qwen2")  # biases on q/k/v
    prompt = [5, 9, 17, 33, 65, 129, 7]
    with torch.inference_mode():
        own = model(torch.tensor([prompt])).logits[0]
        forward = ModelForward(model)
        forward.linears = PackedLinears(model)
        ours = forward(forward.new_cache(), prompt, 0)
    torch.testing.assert_close(ours, own, rtol=0, atol=1e-4)
    assert torch.equal(ours.argmax(-1), own.argmax(-1))


def test_the_switch_turns_it_off(monkeypatch, caplog):
    monkeypatch.setenv(rowkernel.SWITCH, "off")
    with caplog.at_level(logging.INFO, logger="lookahead.rowkernel"):
        assert rowkernel.load.__wrapped__() is None
    assert "LOOKAHEAD_ROW_KERNEL is off" in caplog.text


def test_a_lock_left_by_a_stopped_build_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    old = time.time() - rowkernel.STALE_LOCK_SECONDS - 5
    os.utime(stale, (old, old))
    rowkernel._clear_stale_lock(stale)
    rowkernel._clear_stale_lock(fresh)  # another process building now: its lock stays
    rowkernel._clear_stale_lock(tmp_path / "none")
    assert not stale.exists() and fresh.exists()
    assert "a row kernel build that was stopped" in caplog.text


def test_without_a_compiler_it_says_so_and_is_not_used(monkeypatch, caplog):
    monkeypatch.setenv(rowkernel.SWITCH, "on")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert rowkernel.load.__wrapped__() is None
    assert "no C++ compiler or ninja" in caplog.text
