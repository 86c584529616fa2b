"""The llama.cpp backend: exact against llama.cpp's own greedy decoding, its KV invariants, vocabulary, bad input.

The reference is llama-cpp-python's `Llama` decoding greedily, one token a step, on the same GGUF
file. `make` builds llama.cpp without llamafile's matrix kernels, so a multi-token verification
pass sums exactly as the one-token step does and every output must be identical; on a build with
them, the exactness tests are skipped (the backend warns about that build).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from dataclasses import replace
from importlib import metadata

import numpy as np
import pytest
from conftest import BENCHMARK_SETS, hf_greedy

from lookahead import LookaheadConfig, LookaheadEngine, load_model
from lookahead.bench.datasets import load_prompts
from lookahead.bench.llamaworker import greedy
from lookahead.cli import main
from lookahead.drafting.tree import DraftTree
from lookahead.models import _gguf_key

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp backend is not installed (make test installs it)")

from lookahead.backends.llamacpp import model as llamacpp_model  # noqa: E402

pytestmark = pytest.mark.slow
TOKENS = 32
FIXED = LookaheadConfig(policy="fixed", decoding_length=16, branch_length=8)


@pytest.fixture(scope="module")
def q4_1():
    return load_model(backend="llama.cpp", threads=2)


@pytest.fixture(scope="module")
def f32():
    return load_model(backend="llama.cpp", dtype="float32", threads=2)


@pytest.fixture(scope="module")
def prompts(q4_1) -> list[list[int]]:
    """Two real chat prompts of every benchmark set, as ids."""
    _, tokenizer = q4_1
    return [
        [int(t) for t in tokenizer.apply_chat_template([{"role": "user", "content": p.text}],
                                                       add_generation_prompt=True, return_dict=False)]
        for p in load_prompts(BENCHMARK_SETS, 2)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def references(prompts):
    """llama-cpp-python's own greedy outputs of the prompts, TOKENS each, computed once per weights file."""
    outputs: dict[str, list[list[int]]] = {}

    def of(model) -> list[list[int]]:
        if str(model.path) not in outputs:
            outputs[str(model.path)] = llama_greedy(model, prompts, TOKENS)
        return outputs[str(model.path)]

    return of


def llama_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """llama-cpp-python's own greedy decoding of the same file: one token a step, up to its end-of-generation set."""
    reference = llama_cpp.Llama(str(model.path), n_ctx=2048, n_threads=2, n_threads_batch=2, verbose=False)
    outputs = [greedy(reference, ids, model.vocabulary.end_ids, max_new_tokens) for ids in prompts]
    reference.close()
    return outputs


def require_exact(model) -> None:
    if not model.exact:
        pytest.skip("this llama-cpp-python build has llamafile's kernels: multi-token passes round differently")


@pytest.mark.parametrize(
    ("weights", "config"),
    [("q4_1", FIXED), ("f32", LookaheadConfig(recycled=8))],
    ids=["q4_1-fixed", "f32-adaptive-recycled"],
)
def test_plain_and_lookahead_equal_llama_cpp_greedy(request, prompts, references, weights, config):
    model, tokenizer = request.getfixturevalue(weights)
    require_exact(model)
    want = references(model)
    engine = LookaheadEngine(model, tokenizer, config)
    assert engine.backend.name == "llama.cpp" and engine.tree_mode
    plain = [engine.generate(ids, TOKENS, use_lookahead=False).token_ids for ids in prompts]
    assert plain == want, "empty drafts: one token a step, as llama.cpp's own loop"
    outputs = [engine.generate(ids, TOKENS) for ids in prompts]
    assert [out.token_ids for out in outputs] == want
    drafted = sum(out.stats.draft_tokens for out in outputs)
    accepted = sum(out.stats.new_tokens - out.stats.steps - 1 for out in outputs)
    assert drafted > 0 and accepted > 0, "drafts must have been verified and accepted"


def _check_memory(engine, batch) -> None:
    """Between steps: a row's sequence holds its tokens but the last and the pending; no other but the kept prefix's
    holds any. On a context with a stream per sequence the rows hold the lowest ids, without a gap."""
    verifier = engine.backend.verifier
    model = verifier.model
    rows = {verifier.sequence(g): g for g in batch.running}
    for sequence, generation in rows.items():
        assert model.last_position(sequence) == len(generation.tokens) - 2 - verifier.pending(generation)
    held = {verifier.sequence(g) for g in batch.prefilling} | set(rows) | {model.kept} - {None}
    assert model.rows == len(held)
    assert all(model.last_position(s) == -1 for s in range(model.sequences) if s not in held)
    if model.streams:
        assert held == set(range(len(held)))


@pytest.mark.parametrize("weights", ["f32", "q4_1"])
def test_batched_rows_joining_leaving_and_cancelled_are_each_the_row_alone(request, weights, prompts, references):
    """A batch runs on streams of its own (every row reads only its cells): each row's output is, bit for bit, what
    llama.cpp's own greedy decoding gives the prompt alone, while rows leave from the middle of the ids — on
    quantized weights too, whose batched rows differed from the row alone on most prompts in a unified cache."""
    model, tokenizer = request.getfixturevalue(weights)
    require_exact(model)
    lengths = [TOKENS, 12, 25, TOKENS, 7, 30, 18, TOKENS]
    want = references(model)
    engine = LookaheadEngine(model, tokenizer, FIXED)
    batch = engine.batch(3)
    verifier = engine.backend.verifier
    assert verifier.model.streams and verifier.model.sequences >= 3 and not model.streams
    generations = [engine.prepare(ids, n) for ids, n in zip(prompts, lengths, strict=True)]
    for generation in generations:
        batch.add(generation)
    assert verifier.max_leaves(generations[0]) == 1, "a token is in one stream only: drafts are single paths"
    cancelled, its_steps = generations[3], 0
    ids: dict[int, set[int]] = {}
    while batch:
        batch.step()
        its_steps += cancelled in batch.running
        if its_steps == 2:
            batch.cancel(cancelled)
        _check_memory(engine, batch)
        for generation in batch.running:
            ids.setdefault(id(generation), set()).add(verifier.sequence(generation))
    assert its_steps >= 2 and verifier.model.rows == 0
    assert any(len(held) > 1 for held in ids.values()), "a row left below another, which moved into its stream"
    for number, (generation, n) in enumerate(zip(generations, lengths, strict=True)):
        if generation is not cancelled:
            assert generation.output().token_ids == want[number][:n], number
    assert sum(g.stats.draft_tokens for g in generations) > 0
    alone = LookaheadEngine(model, tokenizer, FIXED)
    assert alone.tree_mode and alone.backend.verifier.max_leaves(generations[0]) > 1, "one stream keeps its trees"


def _joined_on_streams(weights, prompts: list[list[int]]):
    """A batching engine's verifier (on its streamed context) and a generation of each prompt joined to it."""
    model, tokenizer = weights
    require_exact(model)
    engine = LookaheadEngine(model, tokenizer, FIXED)
    engine.batch(len(prompts))
    generations = [engine.prepare(ids, TOKENS) for ids in prompts]
    for generation in generations:
        engine.verifier.join(generation)
    return engine.verifier, generations


def test_streamed_rows_of_unequal_chains_and_a_prefilling_row_between_them(f32, prompts, references):
    """Rows of a call on streams are padded to the widest (and an id between them whose row is still reading its
    prompt is padded too): each row's verdict takes the true tokens its chain holds, and every sequence holds after
    the call what it held before, plus its accepted tokens."""
    want = references(f32[0])
    verifier, generations = _joined_on_streams(f32, prompts[:3])
    streamed = verifier.model
    first, reading, last = generations
    firsts = verifier.prefill([first, reading, last], [len(first.prompt), 5, len(last.prompt)])
    assert firsts[1] is None and [firsts[0], firsts[2]] == [want[0][0], want[2][0]]
    for generation, token in ((first, firsts[0]), (last, firsts[2])):
        generation.take([token])
    chains = [DraftTree.chain(want[0][1:4]), DraftTree.chain([want[2][1], (want[2][2] + 1) % 49152])]
    verdicts, _ = verifier.verify([last, first], chains[::-1])
    assert verdicts[1].emitted == want[0][1:5], "all three drafts, and the token after them"
    assert verdicts[0].emitted == want[2][1:3], "one draft, then the model's own token"
    assert [streamed.last_position(verifier.sequence(g)) for g in generations] == [
        len(first.prompt) + 3,
        4,
        len(last.prompt) + 1,
    ]  # the root and the accepted nodes; 5 prompt tokens
    for generation in generations:
        verifier.leave(generation)
    assert streamed.rows == 0 and all(streamed.last_position(s) == -1 for s in range(streamed.sequences))


def test_each_engines_batches_get_streams_of_their_own_freed_with_it(q4_1, prompts):
    """Two engines batching at once on one model each hold their own streamed context (their rows' ids do not
    mix), a larger batch moves an engine to a larger one, and a context is freed when its engine goes."""
    model, tokenizer = q4_1
    before = len(model._contexts)
    engines = [LookaheadEngine(model, tokenizer, FIXED) for _ in range(2)]
    batches = [engine.batch(2) for engine in engines]
    for batch, engine in zip(batches, engines, strict=True):
        for ids in prompts[:2]:
            batch.add(engine.prepare(ids, 4))
    while any(batches):
        for batch in batches:
            if batch:
                batch.step()
    assert len(model._contexts) == before + 2
    engines[0].batch(4)
    assert engines[0].verifier.model.sequences == 4 and engines[1].verifier.model.sequences == 2
    del engines, batches, batch, engine
    gc.collect()
    assert len(model._contexts) == before


def test_two_rows_leaving_before_a_call_move_two_streams(f32, prompts, references):
    """Rows at ids 1 and then 0 leave before the next call: the rows at ids 3 and 2 move into their streams, one copy
    queued after the other, and both go on exactly."""
    want = references(f32[0])
    verifier, generations = _joined_on_streams(f32, prompts[:4])
    firsts = verifier.prefill(generations, [len(g.prompt) for g in generations])
    for generation, token in zip(generations, firsts, strict=True):
        generation.take([token])
    verifier.leave(generations[1])
    verifier.leave(generations[0])
    staying = generations[2:]
    assert sorted(verifier.sequence(g) for g in staying) == [0, 1]
    verdicts, _ = verifier.verify(staying, [DraftTree.chain(want[n][1:3]) for n in (2, 3)])
    assert [verdict.emitted for verdict in verdicts] == [want[2][1:4], want[3][1:4]]
    for generation in staying:
        verifier.leave(generation)


def test_an_adaptive_batch_of_any_size_prices_and_runs_on_streams(f32, prompts, references):
    """The cost model measures batched steps of 2 and 4 rows for a batch of 3: the streamed context holds them all.
    Once an engine batches, its drafts are single paths, and a request it could not hold is refused up front."""
    model, tokenizer = f32
    require_exact(model)
    want = references(model)
    engine = LookaheadEngine(model, tokenizer)
    outputs = engine.generate_batch(prompts[:3], TOKENS, max_batch=8, progress=False)
    assert [out.token_ids for out in outputs] == want[:3]
    assert engine.verifier.model.sequences == 4 and engine.draft_mode == "chain" and not engine.tree_mode
    assert engine.max_positions < engine.verifier.model.cells
    with pytest.raises(ValueError, match=r"exceeds the model's context"):
        engine.generate_batch([[1] * engine.max_positions], 8, progress=False)


def test_a_rows_leaves_share_the_sequence_ids(q4_1):
    model, tokenizer = q4_1
    engine = LookaheadEngine(model, tokenizer, FIXED)
    verifier = engine.backend.verifier
    generations = [engine.prepare([5, 6, 7], 4) for _ in range(16)]
    for generation in generations[:1]:
        verifier.join(generation)
    assert verifier.max_leaves(generations[0]) == FIXED.decoding_length
    for generation in generations[1:]:
        verifier.join(generation)
    assert model.rows == 16 + (model.kept is not None)
    assert verifier.max_leaves(generations[0]) == (model.sequences - model.rows) // model.rows
    for generation in generations:
        verifier.leave(generation)
    assert model.rows == 1, "only the kept prefix"


NEAR_TIE = 0.05
"""Largest top-2 logit margin a divergence between the two backends may have (f32 weights; llama.cpp keeps its
KV cache in f16, transformers in f32): anything wider is a bug, not rounding."""


def test_the_same_trees_get_the_same_verdicts_on_both_backends(f32, default_model, prompts):
    """Trees built from transformers' greedy continuation with a wrong sibling at every level, stepped on both."""
    import torch

    hf_model, _ = default_model
    model, tokenizer = f32
    engines = [LookaheadEngine(hf_model, tokenizer, FIXED), LookaheadEngine(model, tokenizer, FIXED)]
    near_ties = []
    for ids in prompts[:4]:
        want = hf_greedy(hf_model, ids, 24)
        generations = [engine.prepare(ids, 24) for engine in engines]
        for engine, generation in zip(engines, generations, strict=True):
            engine.verifier.join(generation)
            generation.take([engine.verifier.prefill([generation], [len(ids)])[0]])
        while not generations[0].done:
            done = len(generations[0].transcript.tokens)
            truth = want[done : done + 4]
            tokens, parents = [], []
            for depth, token in enumerate(truth):  # node 2k+1: the true token; 2k+2: a wrong sibling
                parent = 0 if depth == 0 else 2 * depth - 1
                tokens += [token, (token + 1) % 49152]
                parents += [parent, parent]
            tree = DraftTree(tokens, parents)
            verdicts = [
                engine.verifier.verify([g], [tree])[0][0] for engine, g in zip(engines, generations, strict=True)
            ]
            if verdicts[0] != verdicts[1]:
                ours, theirs = (verdict.emitted for verdict in verdicts)
                first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
                context = ids + generations[0].transcript.tokens + verdicts[0].emitted[:first]
                with torch.inference_mode():
                    logits = hf_model(torch.tensor([context])).logits[0, -1]
                top = logits.topk(2).values
                near_ties.append(float(top[0] - top[1]))
                break
            for generation, verdict in zip(generations, verdicts, strict=True):
                generation.take(verdict.emitted)
        for engine, generation in zip(engines, generations, strict=True):
            engine.verifier.leave(generation)
    print(f"verdicts that differ between transformers and llama.cpp (top-2 margins): {near_ties}")
    assert all(margin < NEAR_TIE for margin in near_ties), near_ties
    assert len(near_ties) <= 1


def test_seeded_sampling_is_the_same_with_and_without_lookahead(f32, prompts):
    model, tokenizer = f32
    require_exact(model)
    engine = LookaheadEngine(model, tokenizer, replace(FIXED, recycled=8))
    for seed, ids in enumerate(prompts[:4]):
        options = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "seed": seed}
        fast = engine.generate(ids, TOKENS, **options)
        assert fast.token_ids == engine.generate(ids, TOKENS, use_lookahead=False, **options).token_ids
        assert fast.token_ids != engine.generate(ids, TOKENS, **{**options, "seed": seed + 100}).token_ids


def test_a_tokenizer_of_another_vocabulary_is_refused(q4_1):
    model, tokenizer = q4_1
    texts = model._token_texts()
    llamacpp_model.check_vocabulary(texts, tokenizer, "model.gguf")
    texts[100] = texts[100] + "x"
    with pytest.raises(ValueError, match=r"model.gguf: token 100 is .* the tokenizer is not this model's") as err:
        llamacpp_model.check_vocabulary(texts, tokenizer, "model.gguf")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="the tokenizer has 49152 tokens, the GGUF vocabulary 100"):
        llamacpp_model.check_vocabulary(texts[:100], tokenizer, "model.gguf")


def test_bad_backend_input_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--backend", "llama.cpp", "--model", str(tmp_path), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lookahead: error:") and "runs GGUF files" in err and "\n" not in err
    assert main(["generate", "--backend", "llama.cpp", "--model", str(tmp_path / "missing.gguf"), "hi"]) == 2
    assert "no such file" in capsys.readouterr().err

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(llamacpp_model.metadata, "version", missing)
    assert main(["generate", "--backend", "llama.cpp", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'lookahead[llama]'" in err and "\n" not in err


def test_the_batch_benchmark_runs_client_streams_on_llama_cpp(tmp_path, q4_1):
    from lookahead.bench.batchbench import main as batch_main

    model, _ = q4_1
    require_exact(model)
    args = ["--backend", "llama.cpp", "--dtype", "file", "--prompts", "3", "--prompts-per-stream", "2"]
    assert batch_main([*args, "--max-new-tokens", "6", "--streams", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "batch.json").read_text())
    assert {row["method"] for row in result["results"]} == {"lookahead, one at a time", "batched lookahead",
                                                             "batched plain"}  # fmt: skip
    assert all(row["exact_match"] == 1.0 for row in result["results"]) and result["hf_continuous_batching"] is None


def test_the_llama_cpp_benchmark_runs_every_method_and_checks_every_output(tmp_path):
    from lookahead.bench import llamabench

    out = tmp_path / "llama"
    args = ["--weights", "file", "--sets", "gsm8k", "--limit", "1", "--max-new-tokens", "8", "--streams", "2"]
    # this interpreter as the "default build": its worker process must decode as the build imported here does
    assert llamabench.main([*args, "--default-build", sys.executable, "--out", str(out)]) == 0
    result = json.loads((out / "llamabench.json").read_text())
    methods = {row["method"] for row in result["one_stream"] if row["dataset"] == "all"}
    assert methods == {"llama.cpp plain", "llama.cpp prompt lookup", "plain (ours, llama.cpp)", "lookahead (llama.cpp)",
                       "llama.cpp plain (default build)"}  # fmt: skip
    assert all(row["new_tokens"] > 0 and row["identical"] == "1/1" for row in result["one_stream"])
    assert all(row["vs_default_build"] > 0 for row in result["one_stream"])
    assert [row["streams"] for row in result["batches"]] == [2, 2]
    assert "llama.cpp plain" in (out / "llamabench.md").read_text()


def test_the_llama_cpp_benchmark_refuses_options_it_cannot_run():
    from lookahead.bench import llamabench

    with pytest.raises(SystemExit, match="unknown --transformers float16"):
        llamabench.main(["--transformers", "float32,float16"])
    with pytest.raises(SystemExit, match="bfloat16 runs beside the weights of its type or the float32 weights"):
        llamabench.main(["--weights", "file", "--transformers", "bfloat16"])
    with pytest.raises(SystemExit, match="--default-build: no interpreter at /nowhere/python"):
        llamabench.main(["--default-build", "/nowhere/python"])


@pytest.fixture(scope="module")
def quantized(f32):
    """The bundled model's float32 file quantized by llama.cpp's own quantizer to a file type (e.g. 'Q8_0').

    Kept in the cache beside the float32 file, named by the quantizer's version and the source's identity, so that
    later runs reuse the file and with it the cost curves and tokenizer cached for its path (a fresh path each run
    would measure them again and leave them behind)."""
    source = f32[0].path
    folder = source.parent.parent / f"quantized-llama-cpp-{metadata.version('llama-cpp-python')}-{_gguf_key(source)}"

    def of(kind: str):
        target = folder / f"{kind}.gguf"
        if not target.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
            params.nthread = 2
            scratch = folder / f".{kind}-{os.getpid()}.gguf"
            assert (
                llama_cpp.llama_model_quantize(str(source).encode(), str(scratch).encode(), ctypes.byref(params)) == 0
            )
            os.replace(scratch, target)  # whole or not at all: an interrupted run leaves no half file under the name
        return target

    return of


def _widest_exact_pass(path, widest: int = 16) -> int:
    """Measured through llama-cpp-python's own `Llama`: the widest pass (2 to `widest` tokens, after 40 cached ones) up
    to which every pass gives each token the logits of its one-token step, bit for bit (1: none does)."""
    llama = llama_cpp.Llama(str(path), n_ctx=512, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
    tokens = [(100 + 7 * i) % 40000 for i in range(40 + widest)]

    def logits(width: int) -> np.ndarray:
        llama.reset()
        llama.eval(tokens[:40])
        for start in range(40, 40 + widest, width):
            llama.eval(tokens[start : min(start + width, 40 + widest)])
        return np.array(llama.scores[40 : 40 + widest])

    steps = logits(1)
    try:
        return next((width - 1 for width in range(2, widest + 1) if not np.array_equal(logits(width), steps)), widest)
    finally:
        llama.close()


def test_exact_weight_types_verify_as_the_one_token_step_and_k_quants_do_not(f32, quantized):
    """What EXACT_TYPES claims, measured: passes of every width up to 16 give the one-token step's bits on those
    types; on a K-quant they do not, and the model says so."""
    require_exact(f32[0])
    for kind in ("Q8_0", "Q4_0"):
        assert kind in llamacpp_model.EXACT_TYPES and _widest_exact_pass(quantized(kind)) == 16, kind
    assert _widest_exact_pass(quantized("Q6_K")) < 16
    loaded, _ = load_model(str(quantized("Q6_K")), backend="llama.cpp", threads=2)
    assert "Q6_K" in loaded.inexact_types and f32[0].inexact_types == ()
    loaded.close()


def test_weight_types_are_read_from_the_header_as_the_gguf_package_reads_them(quantized, tmp_path):
    import gguf

    path = quantized("Q4_K_M")
    assert llamacpp_model.weight_types(llama_cpp, path) == {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K"} <= llamacpp_model.weight_types(llama_cpp, path)
    (tmp_path / "not.gguf").write_bytes(b"GGUF" + bytes(60))
    assert llamacpp_model.weight_types(llama_cpp, tmp_path / "not.gguf") == {"unknown"}


def test_k_quant_weights_draft_chains_no_wider_than_their_kernels_keep_exact(f32, quantized, prompts):
    """A Q4_K_M file (llama.cpp repacks its Q4_K weights: passes of 4 tokens round otherwise): the engine finds the
    widest exact pass itself, drafts single paths within it, warns, and equals llama.cpp's greedy decoding."""
    require_exact(f32[0])
    path = quantized("Q4_K_M")
    model, tokenizer = load_model(str(path), backend="llama.cpp", threads=2)
    with pytest.warns(UserWarning, match="Q4_K, Q6_K weights: this file rounds a pass of more than"):
        engine = LookaheadEngine(model, tokenizer)
    assert engine.draft_mode == "chain" and engine.backend.max_draft == _widest_exact_pass(path) - 1 >= 1
    want = llama_greedy(model, prompts, TOKENS)
    outputs = [engine.generate(ids, TOKENS) for ids in prompts]
    assert [out.token_ids for out in outputs] == want
    accepted = sum(out.stats.new_tokens - out.stats.steps - 1 for out in outputs)
    assert sum(out.stats.draft_tokens for out in outputs) > 0 and accepted > 0
    model.close()


def test_weights_no_pass_of_which_is_exact_decode_plainly(quantized, prompts, monkeypatch):
    from lookahead.backends.llamacpp import backend

    monkeypatch.setattr(backend, "widest_exact_pass", lambda model, widest: 1)
    model, tokenizer = load_model(str(quantized("Q6_K")), backend="llama.cpp", threads=2)
    with pytest.warns(UserWarning, match="drafting is off, decoding is plain"):
        engine = LookaheadEngine(model, tokenizer)
    assert engine.draft_mode == "off"
    out, plain = engine.generate(prompts[0], 8), engine.generate(prompts[0], 8, use_lookahead=False)
    assert out.stats.draft_tokens == 0 and out.token_ids == plain.token_ids
    model.close()
