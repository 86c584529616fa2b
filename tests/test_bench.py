"""The benchmarks end to end on a few prompts (harness, batch, long documents, sharing); their argument checks."""

import json
import time
from pathlib import Path

import pytest

from lookahead.bench.datasets import DATASETS, load_prompts
from lookahead.cli import main

CONTRACT_KEYS = {"dataset", "method", "prompts", "new_tokens", "seconds", "tokens_per_s", "edl", "speedup",
                 "exact_match"}  # fmt: skip


def test_every_data_set_loads_from_its_package():
    for name in DATASETS:
        prompts = load_prompts([name], 3)
        assert len(prompts) == 3 and all(p.text.strip() and p.dataset == name for p in prompts)
    assert "canonical" not in load_prompts(["code-edit"], 1)[0].text
    assert "def has_close_elements" in load_prompts(["code-edit"], 1)[0].text


@pytest.mark.parametrize(
    "args",
    [
        ["--datasets", "humaneval,nope"],
        ["--methods", "plain,warp-drive"],
        ["--limit", "0"],
        ["--json", "/proc/no/such/dir/out.json"],
        ["--config", "missing-settings"],
        ["--config", "v:colour=3"],
        ["--config", "v:decoding_length=many"],
        ["--config", "v:policy=psychic"],
        ["--config", "v:trie_half_life=soon"],
        ["--config", "v:trie_max_nodes=1.5"],
    ],
)
def test_bad_arguments_fail_fast_before_loading_a_model(args, capsys):
    clock = time.perf_counter()
    assert main(["bench", *args]) == 2
    assert time.perf_counter() - clock < 5, "the model must not be loaded for a user mistake"
    err = capsys.readouterr().err
    assert err.startswith("lookahead: error:") and err.count("\n") == 1


def test_config_variants_of_every_field_type_are_accepted(tmp_path):
    from lookahead.bench.cli import validate
    from lookahead.cli import build_parser

    spec = "v:trie_max_nodes=100000,trie_half_life=100,min_score=0.05,decoding_length=8,trie_max_nodes=none"
    args = build_parser().parse_args(["bench", "--config", spec, "--out", str(tmp_path)])
    _, methods, variants = validate(args)
    config = variants["v"]
    assert methods[-1] == "v" and config.trie_max_nodes is None and config.trie_half_life == 100.0
    assert config.min_score == 0.05 and config.decoding_length == 8


@pytest.mark.slow
def test_harness_on_one_prompt_of_two_sets(tmp_path):
    out = tmp_path / "run"
    args = ["bench", "--datasets", "humaneval,code-edit", "--limit", "1", "--max-new-tokens", "10", "--out", str(out),
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main([*args, "--config", "wide:decoding_length=32,branch_length=8"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result == json.loads((out / "results.json").read_text())
    rows = result["results"]
    assert all(row.keys() >= CONTRACT_KEYS for row in rows)
    by = {(r["dataset"], r["method"]): r for r in rows}
    assert {row["dataset"] for row in rows} == {"humaneval", "code-edit", "all"}
    for dataset in ["humaneval", "code-edit", "all"]:
        for method in ["plain", "hf-greedy", "hf-prompt-lookup", "lookahead", "wide"]:
            assert (dataset, method) in by
        assert by[(dataset, "plain")]["speedup"] == 1.0
        assert by[(dataset, "lookahead")]["exact_match"] == 1.0
        assert by[(dataset, "wide")]["exact_match"] == 1.0
        assert by[(dataset, "hf-greedy")]["exact_match"] == 1.0
    assert by[("all", "lookahead")]["prompts"] == 2 and by[("all", "lookahead")]["new_tokens"] == 2 * 10
    for plot in ("speedup.png", "accepted.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| code-edit | lookahead |" in (out / "results.md").read_text()
    assert result["divergences"] == []


@pytest.mark.slow
def test_a_divergence_is_reported_where_it_starts_with_plains_margin_there(default_model):
    """A planted difference at position 3: found there, with a positive margin for plain's own token."""
    import torch

    from lookahead.bench.datasets import load_prompts
    from lookahead.bench.runner import Bench, Sample

    model, tokenizer = default_model
    bench = Bench(model, tokenizer, ["plain", "lookahead"], {}, 8)
    prompt = load_prompts(["humaneval"], 1)[0]
    ids = bench.chat_ids([{"role": "user", "content": prompt.text}])
    plain = bench.run("plain", prompt, ids)
    changed = [*plain.token_ids[:3], (plain.token_ids[3] + 1) % 1000, *plain.token_ids[4:]]
    samples = [plain, Sample(prompt.dataset, "lookahead", prompt.key, changed, 1.0, 4, 8),
               Sample(prompt.dataset, "hf-greedy", prompt.key, plain.token_ids, 1.0, None, None)]  # fmt: skip
    [found] = bench.divergences(samples, [prompt])
    assert found["method"] == "lookahead" and found["position"] == 3 and found["reference_margin"] > 0
    with torch.inference_mode():
        logits = model(torch.tensor([ids + plain.token_ids[:3]])).logits[0, -1]
    assert int(logits.argmax()) == plain.token_ids[3], "the margin is taken where plain's own token is the top one"


def test_summary_keeps_data_sets_with_the_same_prompt_keys_apart():
    from lookahead.bench.runner import Sample, summarize

    samples = [
        Sample("humaneval", "plain", "HumanEval/0", [1, 2], 2.0, 2, 0),
        Sample("humaneval", "lookahead", "HumanEval/0", [1, 2], 1.0, 1, 3),
        Sample("code-edit", "plain", "HumanEval/0", [5, 6, 7], 3.0, 3, 0),
        Sample("code-edit", "lookahead", "HumanEval/0", [5, 6, 8], 1.0, 1, 3),
    ]
    rows = {(r["dataset"], r["method"]): r for r in summarize(samples, ["plain", "lookahead"])}
    assert rows[("humaneval", "lookahead")]["speedup"] == 2.0
    assert rows[("humaneval", "lookahead")]["exact_match"] == 1.0
    assert rows[("code-edit", "lookahead")]["speedup"] == 3.0
    assert rows[("code-edit", "lookahead")]["exact_match"] == 0.0
    assert rows[("all", "lookahead")]["speedup"] == 2.5 and rows[("all", "lookahead")]["exact_match"] == 0.5


@pytest.mark.slow
def test_batch_benchmark_on_a_few_prompts(tmp_path):
    from lookahead.bench.batchbench import main as batch_main

    args = ["--prompts", "3", "--prompts-per-stream", "2", "--max-new-tokens", "6", "--streams", "1,2"]
    assert batch_main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "batch.json").read_text())
    methods = {(row["streams"], row["method"]) for row in result["results"]}
    assert methods == {(1, "lookahead, one at a time"), (1, "lookahead, single-stream engine")} | {
        (streams, method)
        for streams in (1, 2)
        for method in ("batched lookahead", "batched plain", "transformers generate, static batches")
    }
    for row in result["results"]:
        requests = 4 if row["method"] == "lookahead, one at a time" else max(3, 2 * row["streams"])
        assert row["exact_match"] == 1.0 and row["requests"] == requests and 0 < row["new_tokens"] <= 6 * requests
        assert row["tokens_per_s"] > 0
        if row["method"].startswith("batched") or row["method"].endswith("engine"):  # the interleaved runs:
            assert row["saturated_tokens_per_s"] > 0  # a request waited in each, its rounds counted apart
    assert "| 2 | batched lookahead |" in (tmp_path / "batch.md").read_text()
    for plot in ("throughput.png", "latency.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, named",
    [
        (["--sets", "humaneval,poetry"], "--sets"),
        (["--streams", "0,2"], "--streams"),
        (["--prompts", "0"], "--prompts"),
        (["--config", "recycled:recycled=-1"], "--config"),
        (["--dtype", "file"], "--dtype file"),
    ],
)
def test_batch_benchmark_refuses_bad_arguments(args, named, capsys):
    from lookahead.bench.batchbench import main as batch_main

    with pytest.raises(SystemExit) as exit_:
        batch_main(args)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_long_document_benchmark_on_short_documents(tmp_path):
    from lookahead.bench.longdoc import FIRST_TOKEN_COLUMNS
    from lookahead.bench.longdoc import main as longdoc_main

    args = ["--lengths", "400", "--per-length", "1", "--max-new-tokens", "8", "--index-lengths", "500,2000",
            "--ttft-length", "300", "--ttft-runs", "2"]  # fmt: skip
    assert longdoc_main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "longdoc.json").read_text())
    assert [(row["length"], row["phase"]) for row in result["summary"]] == [(400, "fresh engine"), (400, "warm engine")]
    assert all(row["decode_speedup"] > 0 for row in result["summary"])
    assert result["command"].endswith(" ".join([*args, "--out", str(tmp_path)]))
    for row in result["results"]:
        assert row["exact"] and row["length"] - 64 <= row["prompt_tokens"] <= row["length"]
        assert row["lookahead_s"] > 0 and row["plain_s"] > 0 and 0 < row["ttft_lookahead_s"] < row["lookahead_s"]
    (first,) = result["first_token"]
    assert set(FIRST_TOKEN_COLUMNS) <= first.keys() and first["outside_prefill_lookahead_ms"] >= 0
    assert first["runs"] == len(first["lookahead_s"]) == len(first["plain_s"]) == 2
    assert 300 - 64 <= first["prompt_tokens"] <= 300 and min(first["lookahead_s"] + first["plain_s"]) > 0
    assert [row["tokens"] for row in result["indexing"]] == [500, 2000]
    assert all(0 < row["index_bytes_per_token"] <= 16 for row in result["indexing"])
    assert "| 400 | warm engine |" in (tmp_path / "longdoc.md").read_text()


def test_sharing_replay_lets_every_replica_draft_from_every_answer():
    from pathlib import Path

    from lookahead.bench.replay import load_records
    from lookahead.bench.sharing import serve, tokens_per_step, workload

    header, records = load_records(Path(__file__).parent.parent / "benchmarks" / "replay" / "smollm2-135m.jsonl")
    requests = workload(records[:6], "repeated")
    assert [r["key"] for r in requests[:6]] == [r["key"] for r in records[:6]] and len(requests) == 12
    assert sorted(r["key"] for r in requests[6:]) == sorted(r["key"] for r in records[:6])
    one = serve(header, requests, 1, shared=False)
    isolated = serve(header, requests, 2, shared=False)
    shared = serve(header, requests, 2, shared=True)
    late = serve(header, requests, 2, shared=True, lag=100)  # never delivered within the run: isolated
    assert [s.new_tokens for s in shared] == [s.new_tokens for s in one]  # the same answers, whoever serves them
    assert tokens_per_step(shared) > tokens_per_step(isolated)
    assert tokens_per_step(late) == tokens_per_step(isolated)
    with pytest.raises(ValueError):
        serve(header, requests, 0, shared=True)


@pytest.mark.slow
def test_batch_benchmark_batched_only_compares_the_two_batches_and_a_variant(tmp_path):
    from lookahead.bench.batchbench import main as batch_main

    args = ["--sets", "code-edit", "--prompts", "2", "--prompts-per-stream", "2", "--max-new-tokens", "4",
            "--streams", "2", "--batched-only", "--config", "recycled:recycled=8"]  # fmt: skip
    assert batch_main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "batch.json").read_text())
    methods = [row["method"] for row in result["results"]]
    assert methods == ["batched lookahead", "batched plain", "batched lookahead, recycled"]
    assert all(row["exact_match"] == 1.0 and row["requests"] == 4 for row in result["results"])
    assert result["hf_continuous_batching"] is None


@pytest.mark.slow
def test_closed_batch_benchmark_per_set_mixed_and_through_hf_generate(tmp_path):
    from lookahead.bench.closedbench import main as closed_main

    args = ["--sizes", "2", "--sets", "code-edit,mixed", "--passes", "2", "--max-new-tokens", "6", "--hf", "--trace"]
    assert closed_main([*args, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "closed.json").read_text())
    assert [(row["prompts"], row["group"]) for row in result["results"]] == [(2, "code-edit"), (2, "mixed")]
    for row in result["results"]:
        assert row["exact_match"] == 1.0 and row["ratio"] > 0 and len(row["ratios_by_pass"]) == 2
        assert 0 < row["rounds"] <= 6 and row["plain_rounds"] >= row["rounds"]
    (hf_row,) = result["hf_generate"]
    assert hf_row["lookahead_equals_engine_plain"] == 1.0 and hf_row["ratio"] > 0
    runs = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [run["drafts"] for run in runs] == [False, True, True, False] * 2, "methods in turn, order swapped"
    for run in runs:
        steps = [entry for entry in run["passes"] if "rows" in entry]
        prefills = [entry for entry in run["passes"] if "prefill_tokens" in entry]
        assert steps and prefills and all(entry["ms"] > 0 and entry["predicted_ms"] > 0 for entry in steps)
        assert all(entry["tokens"] == entry["rows"] for entry in steps) or run["drafts"]


def test_closed_batch_benchmark_refuses_unknown_sets(capsys):
    from lookahead.bench.closedbench import main as closed_main

    with pytest.raises(SystemExit) as exit_:
        closed_main(["--sets", "code-edit,poetry"])
    assert exit_.value.code == 2 and "--sets" in capsys.readouterr().err


@pytest.mark.parametrize("through", [[], ["--model-forward"]])
def test_pass_time_benchmark_times_both_kinds_of_linear_layers(tmp_path, through):
    from lookahead.bench import passes

    assert passes.main(["--contexts", "16", "--repeats", "1", "--out", str(tmp_path), *through]) == 0
    result = json.loads((tmp_path / "passes.json").read_text())
    assert result["direct_layers"] == (not through), "the bundled Llama runs its layers as one loop, as the engine does"
    rows = result["passes"]
    assert [row["width"] for row in rows] == list(passes.WIDTHS)
    assert all(row["model_ms"] > 0 and row["packed_ms"] > 0 for row in rows)
    assert rows[0]["model_vs_1"] == rows[0]["packed_vs_1"] == 1.0
    assert result["command"].startswith("python -m lookahead.bench.passes")
    assert "| context | width |" in (tmp_path / "passes.md").read_text()


def test_the_page_leads_with_the_summary_and_gives_every_result_set_its_command(tmp_path):
    from lookahead.bench.report import write_page

    root = tmp_path / "benchmarks"
    env = {"device": "cpu", "machine": "x86_64", "torch_threads": "2", "python": "3.11", "torch": "2",
           "transformers": "5"}  # fmt: skip
    run = root / "smollm2-135m"
    run.mkdir(parents=True)
    settings = {"max_new_tokens": 8, "limit": 1, "dtype": "float32", "sampling": "greedy"}
    rows = [{"dataset": "all", "method": "lookahead", "speedup": 1.5}]
    (run / "results.json").write_text(json.dumps({"model": "m", "command": "lookahead bench", "settings": settings,
                                                  "environment": env, "results": rows, "note": "a note"}))  # fmt: skip
    (run / "results.md").write_text("ignored: results.json is rendered")
    other = root / "aaa-trie" / "part"
    other.mkdir(parents=True)
    note = "run of commit abc1234, the other side of an A/B."
    (other / "triebench.json").write_text(json.dumps({"note": note, "command": "python -m x --out y",
                                                      "environment": env}))  # fmt: skip
    (other / "triebench.md").write_text("## Speed\n\n| a |\n|---|\n| 1 |")
    (other / "plot.png").write_bytes(b"")
    summary = root / "SUMMARY.md"
    summary.write_text("# Benchmarks\n\nHow fast: 1.5x.")
    write_page(summary, root, tmp_path / "BENCHMARKS.md")
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert page.startswith("# Benchmarks\n\nHow fast: 1.5x.")
    assert page.index("## smollm2-135m") < page.index("## aaa-trie/part"), "the headline sets come first"
    assert "Command: `python -m x --out y`\n\nNote: run of commit abc1234, the other side of an A/B.\n" in page
    assert "#### Speed" in page and "Command: `lookahead bench`\n\nNote: a note.\n" in page
    assert "![plot](benchmarks/aaa-trie/part/plot.png)" in page
    assert "| all | lookahead |" in page and "ignored" not in page
    assert "- [aaa-trie/part](#aaa-triepart)" in page


def _recorded(datasets: tuple[str, ...], per_set: int) -> tuple[dict, list[dict]]:
    from lookahead.bench.replay import load_records

    header, records = load_records(Path(__file__).parents[1] / "benchmarks/replay/smollm2-135m.jsonl")
    return header, [record for name in datasets for record in [r for r in records if r["dataset"] == name][:per_set]]


def test_a_closed_batch_replays_every_recorded_answer_and_drafts_copies():
    from lookahead.bench.closedreplay import groups, run
    from lookahead.drafting.policy import CostModel

    header, records = _recorded(("code-edit", "mtbench"), 3)
    cost = CostModel(header["cost_ms"], batched={3: {1: 70.0, 2: 80.0, 4: 100.0, 8: 140.0, 32: 400.0}})
    found = groups(records, 3)
    assert [len(found[name]) for name in ("code-edit", "mtbench", "mixed")] == [1, 1, 2]
    assert [record["dataset"] for record in found["mixed"][0]] == ["code-edit", "mtbench", "code-edit"]
    code = found["code-edit"][0]
    plain = run(code, header, cost, drafts=False, closed=False, overhead_ms=0.0)
    closed = run(code, header, cost, drafts=True, closed=True, overhead_ms=0.0)  # raises if an answer changed
    assert plain["rounds"] == max(len(record["output_ids"]) for record in code) - 1, "the first token is prefill's"
    assert closed["rounds"] < plain["rounds"] / 2 and closed["ms"] < plain["ms"]
    assert run(code, header, cost, True, True, overhead_ms=1.0)["ms"] > closed["ms"], "drafting work a row a step"


def test_closed_replay_prices_groups_by_this_machines_curves(tmp_path):
    from lookahead.bench.closedreplay import main as replay_main

    header, records = _recorded(("code-edit", "gsm8k"), 2)
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [header, *records]))
    assert replay_main([str(path), "--size", "2", "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "closed-replay.json").read_text())
    assert [row["group"] for row in result["results"]] == ["code-edit", "gsm8k", "mixed"]
    assert all(row["plain_s"] > 0 and row["closed"] > 0 and row["open"] > 0 for row in result["results"])
    assert result["command"].startswith("python -m lookahead.bench.closedreplay")


def test_every_result_names_the_processor_it_ran_on():
    from lookahead.bench.report import environment

    machine = environment()["machine"]
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            assert line.split(":", 1)[1].strip() in machine, "figures move with the processor: say which one"
        if line.startswith("flags") and " avx2" in line:
            assert "avx2" in machine, "and which vector extensions its kernels can use"


def test_llama_cpp_table_compares_rates_not_times_where_outputs_differ_in_length():
    from lookahead.bench.llamabench import DEFAULT_BUILD, REFERENCE, with_ratios

    rows = [{"weights": "q", "dataset": "all", "method": m, "new_tokens": n, "seconds": s}
            for m, n, s in [(REFERENCE, 100, 10.0), (DEFAULT_BUILD, 50, 4.0), ("lookahead", 100, 5.0)]]  # fmt: skip
    ratios = {row["method"]: (row["vs_llama_cpp"], row["vs_default_build"]) for row in with_ratios(rows)}
    assert ratios == {REFERENCE: (1.0, 0.8), DEFAULT_BUILD: (1.25, 1.0), "lookahead": (2.0, 1.6)}


def test_vllmbench_says_what_suffix_decoding_needs_before_loading_anything(monkeypatch, capsys):
    import importlib.util

    from lookahead.bench import vllmbench

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "arctic_inference" else found(name, *args)
    )
    with pytest.raises(SystemExit) as raised:
        vllmbench.main(["--methods", "plain,suffix"])
    assert raised.value.code == 2
    assert "arctic-inference==0.1.1" in capsys.readouterr().err
