"""Lookahead on llama.cpp against what a GGUF user runs instead: llama.cpp's own decoding and its prompt lookup.

For each weights type of the bundled model (its Q4_1 file as shipped, and a float32 copy):
one stream, every method on every prompt in a rotating order (a shared machine's slow spells
fall on all of them):

- `llama.cpp plain`: llama-cpp-python's `Llama.generate`, greedy, one token a step (the reference);
- `llama.cpp prompt lookup`: the same with `LlamaPromptLookupDecoding` (10 tokens), its own speculation;
- with `--default-build PYTHON`: `llama.cpp plain (default build)`, the same plain decoding by llama-cpp-python
  as it comes (with llamafile's kernels, which read prompts faster but are not exact for drafts: README), run
  by an interpreter that has that build (llamaworker.py);
- `plain (ours, llama.cpp)` and `lookahead (llama.cpp)`: this engine on the same file, without and with drafts;
- with `--transformers` (beside the float32 weights): `plain (ours, transformers)` and `lookahead
  (transformers)`, the engine's other backend on the same weights; `--transformers float32,bfloat16`
  adds the transformers model in bfloat16 too (its outputs are held to its own plain decoding),
  beside the bfloat16 weights where `--weights` has them, else beside the float32 ones.

Then closed batches of `--streams` prompts through `generate_batch` on llama.cpp, plain and lookahead
alternating group by group. Tokens/s count prefill (the whole call, as a user waits for it). Each
output is compared with its reference (llama.cpp plain; for the transformers methods, transformers
plain), and every divergence is reported with the reference's top-2 logit margin at that position (llama.cpp's
one-token step; the transformers model's own pass): a near-tie is rounding, a wide margin would be a bug.

    python -m lookahead.bench.llamabench --out benchmarks/llama-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..engine import LookaheadEngine
from ..models import load_model
from .datasets import Prompt, load_prompts
from .divergence import first_difference, reference_margin
from .llamaworker import Worker, greedy, open_llama
from .report import markdown_table, run_record

SETS = ["code-edit", "humaneval", "gsm8k", "mtbench", "creative"]
REFERENCE = "llama.cpp plain"
DEFAULT_BUILD = "llama.cpp plain (default build)"
COLUMNS = ["weights", "dataset", "method", "prompts", "new_tokens", "tokens_per_s", "vs_llama_cpp", "vs_default_build",
           "tokens_per_step", "identical"]  # fmt: skip
DIVERGENCE_COLUMNS = ["weights", "method", "dataset", "prompt", "position", "reference_margin"]
BATCH_COLUMNS = ["weights", "streams", "method", "prompts", "new_tokens", "tokens_per_s", "vs_plain", "tokens_per_step",
                 "identical"]  # fmt: skip

Run = Callable[[list[int]], tuple[list[int], int | None]]
"""A method on one prompt's ids: its new tokens and its forward passes after prefill (None where not known)."""


def llama_runs(path: Path, threads: int, end_ids: frozenset[int], max_new_tokens: int) -> dict[str, Run]:
    """llama-cpp-python's own decoding of the file, plain and with its prompt lookup."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    plain = open_llama(path, threads)
    lookup = open_llama(path, threads, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))

    def run(llama) -> Run:
        return lambda ids: (greedy(llama, ids, end_ids, max_new_tokens), None)

    return {REFERENCE: run(plain), "llama.cpp prompt lookup": run(lookup)}


def default_build_run(worker: Worker) -> Run:
    """llama.cpp's plain decoding as llama-cpp-python comes (llamafile's kernels), in the worker's interpreter."""
    return lambda ids: (worker.generate(ids), None)


def engine_runs(engines: tuple[LookaheadEngine, LookaheadEngine], label: str, max_new_tokens: int) -> dict[str, Run]:
    """Plain decoding on the first engine, lookahead on the second (on llama.cpp each on a model of its own: a
    model's KV cache keeps the last prompt's cells for the next, as each `Llama` keeps its own)."""

    def run(use_lookahead: bool) -> Run:
        engine = engines[use_lookahead]

        def generate(ids: list[int]) -> tuple[list[int], int | None]:
            out = engine.generate(ids, max_new_tokens, use_lookahead=use_lookahead)
            return out.token_ids, out.stats.steps

        return generate

    return {f"plain (ours, {label})": run(False), f"lookahead ({label})": run(True)}


def one_stream(runs: dict[str, Run], prompts: list[Prompt], ids: list[list[int]], progress: Callable[[str], None]):
    """Every method on every prompt, rotating which goes first; (method, prompt index) -> (tokens, steps, s)."""
    methods = list(runs)
    for method in methods:  # warm-up: first calls pay one-off costs
        runs[method](ids[0][:16])
    samples: dict[tuple[str, int], tuple[list[int], int | None, float]] = {}
    for number, prompt_ids in enumerate(ids):
        shift = number % len(methods)
        for method in methods[shift:] + methods[:shift]:
            clock = time.perf_counter()
            tokens, steps = runs[method](prompt_ids)
            samples[method, number] = (tokens, steps, time.perf_counter() - clock)
        progress(f"{prompts[number].dataset} {number + 1}/{len(ids)}")
    return samples


def summarize_stream(weights: str, samples, prompts: list[Prompt], references: dict[str, str]) -> list[dict]:
    methods = list(dict.fromkeys(method for method, _ in samples))
    rows = []
    for dataset in [*dict.fromkeys(p.dataset for p in prompts), "all"]:
        numbers = [n for n, p in enumerate(prompts) if dataset in ("all", p.dataset)]
        for method in methods:
            tokens = sum(len(samples[method, n][0]) for n in numbers)
            seconds = sum(samples[method, n][2] for n in numbers)
            steps = [samples[method, n][1] for n in numbers]
            reference = references[method]
            same = sum(samples[method, n][0] == samples[reference, n][0] for n in numbers)
            rows.append({
                "weights": weights, "dataset": dataset, "method": method, "prompts": len(numbers),
                "new_tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
                "tokens_per_step": round(tokens / sum(steps), 3) if None not in steps and sum(steps) else None,
                "identical": f"{same}/{len(numbers)}",
            })  # fmt: skip
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s against llama.cpp's plain decoding (and its default build's, where run) on the same
    prompts: rates, not times, since a method whose outputs differ may make more or fewer tokens."""
    rate = {(row["weights"], row["dataset"], row["method"]): row["new_tokens"] / row["seconds"] for row in rows}
    for row in rows:
        own, group = rate[row["weights"], row["dataset"], row["method"]], (row["weights"], row["dataset"])
        default = rate.get((*group, DEFAULT_BUILD))
        row["vs_llama_cpp"] = round(own / rate[(*group, REFERENCE)], 3)
        row["vs_default_build"] = None if default is None else round(own / default, 3)
    return rows


def closed_batches(
    engines: tuple[LookaheadEngine, LookaheadEngine], ids: list[list[int]], streams: int, max_new_tokens: int
) -> dict:
    """Groups of `streams` prompts through generate_batch, plain (first engine) and lookahead (second) alternating
    group by group."""
    for engine in engines:  # warm-up: probes and the batched cost curves
        engine.generate_batch(ids[:streams], 4, max_batch=streams, use_lookahead=False, progress=False)
    outputs: dict[bool, list] = {False: [], True: []}
    seconds = {False: 0.0, True: 0.0}
    for start in range(0, len(ids), streams):
        group = ids[start : start + streams]
        order = (False, True) if (start // streams) % 2 == 0 else (True, False)
        for lookahead in order:
            clock = time.perf_counter()
            outputs[lookahead] += engines[lookahead].generate_batch(
                group, max_new_tokens, max_batch=streams, use_lookahead=lookahead, progress=False
            )
            seconds[lookahead] += time.perf_counter() - clock
    return {"outputs": outputs, "seconds": seconds}


def summarize_batches(weights: str, streams: int, run: dict, alone: list[list[int]]) -> list[dict]:
    rows = []
    plain_rate = sum(len(out.token_ids) for out in run["outputs"][False]) / run["seconds"][False]
    for lookahead, name in ((False, "plain (ours, llama.cpp)"), (True, "lookahead (llama.cpp)")):
        outs = run["outputs"][lookahead]
        tokens = sum(len(out.token_ids) for out in outs)
        steps = sum(out.stats.steps for out in outs)
        seconds = run["seconds"][lookahead]
        rows.append({
            "weights": weights, "streams": streams, "method": name, "prompts": len(outs), "new_tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "vs_plain": round(tokens / seconds / plain_rate, 3),
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "identical": f"{sum(o.token_ids == a for o, a in zip(outs, alone, strict=True))}/{len(outs)}",
        })  # fmt: skip
    return rows


def divergence(weights: str, method: str, prompt: Prompt, position: int, margin: float) -> dict:
    """One output that differs from its reference: where it first does, and the reference's top-2 margin there."""
    return {"weights": weights, "method": method, "dataset": prompt.dataset, "prompt": prompt.key,
            "position": position, "reference_margin": margin}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookahead.bench.llamabench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model or a .gguf file")
    parser.add_argument("--weights", default="float32,file", help="float32, float16, bfloat16, file (as shipped)")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--limit", type=int, default=6, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8, help="rows of the closed batches (0: none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--transformers", nargs="?", const="float32", default="",
                        help="also the transformers backend, in these dtypes (default float32)")  # fmt: skip
    parser.add_argument(
        "--default-build",
        metavar="PYTHON",
        help="an interpreter with llama-cpp-python as it comes: its plain decoding beside the others",
    )
    parser.add_argument("--out", default="bench-out/llama")
    args = parser.parse_args(argv)
    if args.default_build and shutil.which(args.default_build) is None:
        raise SystemExit(f"--default-build: no interpreter at {args.default_build}")
    prompts = load_prompts([s for s in args.sets.split(",") if s], args.limit)
    weights = [w for w in args.weights.split(",") if w]
    if bad := [w for w in weights if w not in ("float32", "float16", "bfloat16", "file")]:
        raise SystemExit(f"unknown --weights {','.join(bad)}: choose from float32, float16, bfloat16, file")
    hf_dtypes = [d for d in args.transformers.split(",") if d]
    if bad := [d for d in hf_dtypes if d not in ("float32", "bfloat16")]:
        raise SystemExit(f"unknown --transformers {','.join(bad)}: choose from float32, bfloat16")
    beside = {dtype: dtype if dtype in weights else "float32" for dtype in hf_dtypes}  # the GGUF it runs beside
    if missing := [dtype for dtype, kind in beside.items() if kind not in weights]:
        raise SystemExit(f"--transformers {','.join(missing)} runs beside the weights of its type or the float32 "
                         "weights: add one to --weights")  # fmt: skip
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, batch_rows, divergences = [], [], []
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    workers: list[Worker] = []
    try:
        for kind in weights:

            def own_engine(kind: str = kind) -> LookaheadEngine:
                model, tokenizer = load_model(args.model, None if kind == "file" else kind, backend="llama.cpp",
                                              threads=args.threads)  # fmt: skip
                return LookaheadEngine(model, tokenizer)

            engines = (own_engine(), own_engine())
            model = engines[0].model
            label = f"{kind} ({model.file_type})"
            say(f"== {label}: {model.path}")
            ids = [engines[0].chat_ids([{"role": "user", "content": prompt.text}]) for prompt in prompts]
            runs = llama_runs(model.path, args.threads, model.vocabulary.end_ids, args.max_new_tokens)
            if args.default_build:
                ends = model.vocabulary.end_ids
                worker = Worker(args.default_build, model.path, args.threads, ends, args.max_new_tokens)
                workers.append(worker)
                say(f"default build: {worker.build}")
                runs[DEFAULT_BUILD] = default_build_run(worker)
            runs.update(engine_runs(engines, "llama.cpp", args.max_new_tokens))
            references = dict.fromkeys(runs, REFERENCE)
            margin_models = dict.fromkeys(runs, model)  # the model whose reference gives a divergence's margin
            for dtype in [dtype for dtype in hf_dtypes if beside[dtype] == kind]:
                hf_model, hf_tokenizer = load_model(args.model, dtype)
                hf_engine = LookaheadEngine(hf_model, hf_tokenizer)
                hf_label = "transformers" if dtype == "float32" else f"transformers {dtype}"
                hf_runs = engine_runs((hf_engine, hf_engine), hf_label, args.max_new_tokens)
                runs.update(hf_runs)
                references.update(dict.fromkeys(hf_runs, f"plain (ours, {hf_label})"))
                margin_models.update(dict.fromkeys(hf_runs, hf_model))
            samples = one_stream(runs, prompts, ids, lambda text, label=label: say(f"{label}: {text}"))
            rows += summarize_stream(label, samples, prompts, references)
            for (method, number), (tokens, _, _) in samples.items():
                want = samples[references[method], number][0]
                index = first_difference(tokens, want) if method != references[method] else None
                if index is not None and index < len(want):
                    margin = reference_margin(margin_models[method], ids[number], want, index)
                    divergences.append(divergence(label, method, prompts[number], index, margin))
            if args.streams > 1:
                run = closed_batches((own_engine(), own_engine()), ids, args.streams, args.max_new_tokens)
                alone = [samples[REFERENCE, n][0] for n in range(len(ids))]
                batch_rows += summarize_batches(label, args.streams, run, alone)
                for lookahead, outs in run["outputs"].items():
                    method = f"{'lookahead' if lookahead else 'plain (ours)'}, {args.streams} streams"
                    for number, output in enumerate(outs):
                        index = first_difference(output.token_ids, alone[number])
                        if index is not None and index < len(alone[number]):
                            margin = reference_margin(model, ids[number], alone[number], index)
                            divergences.append(divergence(label, method, prompts[number], index, margin))
            for engine in engines:
                engine.model.close()
    finally:
        for worker in workers:
            worker.close()

    result = {
        **run_record("lookahead.bench.llamabench", args, argv),
        "one_stream": rows,
        "batches": batch_rows,
        "divergences": divergences,
    }
    (out / "llamabench.json").write_text(json.dumps(result, indent=1))
    tables = [markdown_table(rows, COLUMNS)]
    if batch_rows:
        tables.append(markdown_table(batch_rows, BATCH_COLUMNS))
    tables.append(
        markdown_table(divergences, DIVERGENCE_COLUMNS)
        if divergences
        else "No divergences from any method's reference."
    )
    text = "\n\n".join(tables)
    (out / "llamabench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
