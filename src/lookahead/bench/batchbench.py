"""Throughput and latency under concurrent streams: batched lookahead against batched plain and transformers.

C streams are a closed loop of C clients: each sends the next prompt as soon as its answer is
complete, which is a continuous batch of at most C generations (a finished one makes room for
the next prompt at once). Each client sends at least `--prompts-per-stream` prompts: with one
prompt a client the run is one batch that drains, and its end (the last rows running nearly
alone) weighs as much as the full batch.

For every C: batched lookahead and batched plain decoding through the same model (each run
with an empty trie, the two taking turns round by round, each timed by its own rounds: a shared
machine's slow spells fall on both), and transformers' `model.generate` on padded batches of C
prompts (a static batch: every row waits for the longest); once, for reference, lookahead one
request at a time over all the prompts (what the server did before batching). At C = 1 a third
run takes turns with the two: the same prompts on an engine that never batched (today's
single-stream engine), the reference of the batched path's cost at one stream. Reported per method and C: total
tokens/s with prefill, decode tokens/s (steps only), per-request p50/p99 latency and time to
first token (from the moment its client sends it), tokens per step, and whether every output
equals plain greedy decoding. `saturated_tokens_per_s` counts only the rounds begun while a
request was waiting for a row: the batch full, as in a service under load, without the drain
at the end of a finite list (where a method whose rows end at different times runs its last
rows nearly alone, while one in lock step ends them together).

    python -m lookahead.bench.batchbench --out benchmarks/batch-smollm2-135m

`--batched-only` leaves out the one-at-a-time and transformers runs (a per-set comparison of
the two batched methods, in a quarter of the time); outputs are then checked against batched
plain decoding's. `--backend llama.cpp` runs the same through llama.cpp on the GGUF file's
float32 copy (`--dtype file`: the file as it is), without transformers' static batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..config import LookaheadConfig
from ..decoding.transcript import eos_ids
from ..engine import LookaheadEngine
from ..models import load_model
from .datasets import load_prompts
from .report import add_model_options, markdown_table, run_record
from .runner import parse_variant

SETS = ["humaneval", "gsm8k", "mtbench", "code-edit", "creative"]
SINGLE = "lookahead, single-stream engine"
"""The 1-stream row's reference: an engine that never batched (one row, no slab), run in turn with the batches."""
COLUMNS = ["streams", "method", "requests", "tokens_per_s", "saturated_tokens_per_s", "decode_tokens_per_s",
           "p50_latency_s", "p99_latency_s", "p50_ttft_s", "tokens_per_step", "exact_match"]  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


class _Run:
    """One method's continuous batch in an interleaved comparison, on its own clock: the time of its own rounds."""

    def __init__(
        self,
        engine: LookaheadEngine,
        prompts: list[list[int]],
        streams: int,
        new_tokens: int,
        drafts: bool,
        closed: bool = False,
    ):
        self.batch = engine.batch(streams, use_lookahead=drafts, closed=closed)
        self.generations = [engine.prepare(ids, new_tokens) for ids in prompts]
        for generation in self.generations:
            self.batch.add(generation)
        self.clock = 0.0
        self.saturated = [0.0, 0]
        """Seconds and new tokens of the rounds begun while a generation was waiting for a row."""
        self.joined: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.ended: dict[int, float] = {}

    def round(self) -> None:
        """One round of the batch, timed; every generation's join, first token and end on this run's clock."""
        tick = self.clock
        waiting = bool(self.batch.waiting)
        started = time.perf_counter()
        events = self.batch.step()
        self.clock += time.perf_counter() - started
        if waiting:
            self.saturated[0] += self.clock - tick
            self.saturated[1] += sum(len(kept) for _, kept in events)
        for generation, _ in events:
            key = id(generation)
            self.joined.setdefault(key, tick)
            self.first.setdefault(key, self.clock)
            if generation.done:
                self.ended[key] = self.clock

    def summary(self) -> tuple[list, dict]:
        outputs = [generation.output() for generation in self.generations]
        keys = [id(generation) for generation in self.generations]
        decode_s = self.clock - sum(out.stats.prefill_s for out in outputs)  # prefills run one after another
        latencies = [self.ended[k] - self.joined[k] for k in keys]
        ttfts = [self.first[k] - self.joined[k] for k in keys]
        row = _summary(outputs, self.clock, decode_s, latencies, ttfts)
        seconds, tokens = self.saturated
        return outputs, {**row, "saturated_tokens_per_s": round(tokens / seconds, 2) if seconds else None}


def run_batched(
    engines: dict[str, tuple[LookaheadEngine, bool]],
    prompts: list[list[int]],
    streams: int,
    new_tokens: int,
    closed: bool = False,
) -> dict:
    """C streams through each engine's continuous batch (name -> (engine, whether it drafts)), round by round in turn.

    The methods take turns one round at a time and each is timed by its own rounds only, so
    a slow spell of a shared machine falls on all alike instead of on whichever ran then.
    Returns per method its outputs and figures; the peak resident memory is of all batches.
    `closed`: the prompts are one list to decode, as `generate_batch` takes it (decoding/batch.py: Batch).
    """
    runs = {
        name: _Run(engine, prompts, streams, new_tokens, drafts, closed) for name, (engine, drafts) in engines.items()
    }
    peak_rss = 0.0
    while any(run.batch for run in runs.values()):
        for run in runs.values():
            if run.batch:
                run.round()
        peak_rss = max(peak_rss, _rss_mb())
    results = {}
    for name, run in runs.items():
        outputs, row = run.summary()
        results[name] = (outputs, {**row, "peak_rss_mb": round(peak_rss)})
    return results


def _summary(outputs: list, wall: float, decode_s: float, latencies: list[float], ttfts: list[float]) -> dict:
    """The figures of one run of the engine: throughput with and without prefill, latencies, tokens per step."""
    tokens = sum(len(out.token_ids) for out in outputs)
    steps = sum(out.stats.steps for out in outputs)
    return {
        "requests": len(outputs),
        "new_tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "decode_tokens_per_s": round((tokens - len(outputs)) / decode_s, 2),
        "p50_latency_s": round(statistics.median(latencies), 2),
        "p99_latency_s": round(_percentile(latencies, 0.99), 2),
        "p50_ttft_s": round(statistics.median(ttfts), 3),
        "tokens_per_step": round(tokens / steps, 2) if steps else None,
        "draft_tokens_per_step": round(sum(out.stats.draft_tokens for out in outputs) / steps, 2) if steps else None,
    }


def run_one_at_a_time(engine: LookaheadEngine, prompts: list[list[int]], new_tokens: int):
    """Lookahead, one request after another (the server before batching)."""
    outputs, latencies, ttfts = [], [], []
    clock = time.perf_counter()
    for ids in prompts:
        start = time.perf_counter()
        stream = engine.stream(ids, new_tokens)
        seen_first = None
        for _ in stream:
            seen_first = seen_first or time.perf_counter()
        outputs.append(stream.output)
        latencies.append(time.perf_counter() - start)
        ttfts.append((seen_first or time.perf_counter()) - start)
    wall = time.perf_counter() - clock
    decode_s = sum(out.stats.seconds - out.stats.prefill_s for out in outputs)
    return outputs, _summary(outputs, wall, decode_s, latencies, ttfts)


def run_hf_static(model, tokenizer, prompts: list[list[int]], streams: int, new_tokens: int):
    """transformers' own batching: `model.generate` on left-padded batches of `streams` prompts, one batch at a time."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model.generation_config, tokenizer)
    outputs, latencies = [], []
    clock = time.perf_counter()
    for start in range(0, len(prompts), streams):
        group = prompts[start : start + streams]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        tick = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=pad)  # fmt: skip
        rows = out[:, width:].tolist()
        latencies += [time.perf_counter() - tick] * len(group)
        for row in rows:
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            outputs.append(row[:cut])
    wall = time.perf_counter() - clock
    tokens = sum(map(len, outputs))
    return outputs, {
        "requests": len(prompts),
        "new_tokens": tokens,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "p50_latency_s": round(statistics.median(latencies), 2),
        "p99_latency_s": round(_percentile(latencies, 0.99), 2),
    }


def hf_continuous_batching_note(model, prompts: list[list[int]]) -> str:
    """Whether transformers' own continuous batching (`generate_batch`) runs here, in one line: on a cache of a few
    blocks and without its warm-up (by default it sizes its cache by the free memory and warms up, seconds on a CPU
    that say nothing of whether it runs)."""
    try:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=4, do_sample=False)
        model.generate_batch(inputs=prompts[:2], generation_config=config, **_small_continuous_batching())
    except Exception as err:
        return f"does not run on this machine ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
    return "runs on this machine (not timed here)"


def _small_continuous_batching() -> dict:
    """`generate_batch` options for a cache of a few blocks and no warm-up, where this transformers has them."""
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:  # an earlier transformers 5: its defaults
        return {}
    return {
        "continuous_batching_config": ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256),
        "warmup": False,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--prompts", type=int, default=16, help="requests per run at least, the sets mixed")
    parser.add_argument("--prompts-per-stream", type=int, default=3,
                        help="requests per client at least: C streams send max(--prompts, this x C)")  # fmt: skip
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, mixed in turn (of {', '.join(SETS)})")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument(
        "--batched-only", action="store_true", help="only the two batched runs (outputs checked against plain's)"
    )
    parser.add_argument(
        "--config", action="append", default=[], metavar="NAME:key=value,...",
        help="a lookahead variant, batched beside the default in every run",
    )  # fmt: skip
    parser.add_argument(
        "--backend", choices=("transformers", "llama.cpp"), default="transformers",
        help="the model's runtime (llama.cpp: the GGUF file; transformers' own static batches are left out)",
    )  # fmt: skip
    parser.add_argument("--out", default="bench-out/batch")
    args = parser.parse_args(argv)
    try:
        variants = dict(parse_variant(spec) for spec in args.config)
    except ValueError as err:
        parser.error(str(err))
    sets = [name.strip() for name in args.sets.split(",") if name.strip()]
    if unknown := sorted(set(sets) - set(SETS)):
        parser.error(f"--sets: unknown {', '.join(unknown)} (known: {', '.join(SETS)})")
    if args.prompts < 1 or args.prompts_per_stream < 1:
        parser.error("--prompts and --prompts-per-stream must be at least 1")
    streams = [int(s) for s in args.streams.split(",")]
    if min(streams) < 1:
        parser.error("--streams: every count must be at least 1")
    torch.set_num_threads(args.threads)
    if args.dtype == "file" and args.backend != "llama.cpp":
        parser.error("--dtype file: a GGUF file as it is, on --backend llama.cpp only")
    dtype = None if args.dtype == "file" else args.dtype
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device, backend=args.backend,
                                  threads=args.threads)  # fmt: skip
    with_hf = not args.batched_only and args.backend == "transformers"

    def fresh(batching: bool = True, config: LookaheadConfig | None = None) -> LookaheadEngine:
        """An engine with an empty trie: no run drafts from answers an earlier run learned.

        `batching`: probe batching and price batched steps (cached) before any clock runs; without,
        the engine stays the single-stream engine (one row, never a slab).
        """
        engine = LookaheadEngine(model, tokenizer, config)
        if batching:
            engine.batch(max(streams))
        return engine

    def count_at(streams: int) -> int:
        return max(args.prompts, args.prompts_per_stream * streams)

    engine = fresh()
    total = max(map(count_at, streams))
    per_set = -(-total // len(sets))
    by_set = [load_prompts([name], per_set) for name in sets]
    mixed = [group[i] for i in range(per_set) for group in by_set if i < len(group)][:total]
    prompts = [engine.chat_ids([{"role": "user", "content": p.text}]) for p in mixed]
    engine.generate(prompts[0], 4, use_lookahead=False)  # warm-up

    rows: list[dict] = []
    want: list[list[int]] = []
    if not args.batched_only:
        reference, row = run_one_at_a_time(engine, prompts, args.max_new_tokens)
        want = [out.token_ids for out in reference]
        rows.append({"streams": 1, "method": "lookahead, one at a time", **row, "exact_match": 1.0})
        print(rows[-1], flush=True)

    def exact(outputs: list[list[int]], reference: list[list[int]]) -> float:
        return round(sum(o == w for o, w in zip(outputs, reference, strict=True)) / len(outputs), 3)

    for count in streams:
        some = prompts[: count_at(count)]
        engines = {"batched lookahead": (fresh(), True), "batched plain": (fresh(), False)}
        for name, config in variants.items():
            engines[f"batched lookahead, {name}"] = (fresh(config=config), True)
        if count == 1:  # the same prompts one at a time on an engine that never batched, in turn with the others
            engines[SINGLE] = (fresh(batching=False), True)
        runs = run_batched(engines, some, count, args.max_new_tokens)
        reference = want[: len(some)] or [out.token_ids for out in runs["batched plain"][0]]
        for method, (outs, row) in runs.items():
            rows.append({"streams": count, "method": method, **row,
                         "exact_match": exact([o.token_ids for o in outs], reference)})  # fmt: skip
            print(rows[-1], flush=True)
        if with_hf:
            outs, row = run_hf_static(model, tokenizer, some, count, args.max_new_tokens)
            rows.append({"streams": count, "method": "transformers generate, static batches", **row,
                         "exact_match": exact(outs, reference)})  # fmt: skip
            print(rows[-1], flush=True)
    result = {
        **run_record("lookahead.bench.batchbench", args, argv),
        "hf_continuous_batching": hf_continuous_batching_note(model, prompts) if with_hf else None,
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(rows, COLUMNS)
    (out / "batch.md").write_text(table + "\n")
    plot(
        rows,
        out / "throughput.png",
        out / "latency.png",
        f"{result['model']}, {args.backend}, {args.dtype}, {args.device}",
    )
    print(table)
    if result["hf_continuous_batching"]:
        print("transformers generate_batch:", result["hf_continuous_batching"])
    return 0


def plot(rows: list[dict], throughput: Path, latency: Path, title: str) -> None:
    from .report import _pyplot, _save

    plt = _pyplot()
    for path, key, label in (
        (throughput, "tokens_per_s", "total tokens/s"),
        (latency, "p50_latency_s", "p50 latency per request (s)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for method in dict.fromkeys(r["method"] for r in rows):
            points = sorted((r["streams"], r[key]) for r in rows if r["method"] == method and r.get(key) is not None)
            if len(points) == 1:
                ax.axhline(points[0][1], linestyle="--", color="grey", label=method)
            else:
                ax.plot(*zip(*points, strict=True), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        _save(plt, fig, ax, path, title)


if __name__ == "__main__":
    raise SystemExit(main())
