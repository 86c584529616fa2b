"""`lookahead bench`: check every argument first, then load the model and run with a progress bar."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from ..config import LookaheadConfig
from ..decoding.sampling import request_options
from .datasets import DATASETS, load_prompts
from .replay import RECORDED_FOLLOWING, load_records, record, replay, summarize_replay, sweep_configs
from .report import DIVERGENCE_COLUMNS, environment, markdown_table, plot_accepted, plot_speedup, plot_sweep
from .runner import BUILTIN_METHODS, Bench, parse_variant, summarize


def _writable(path: Path) -> bool:
    """Try it: create the directory and a scratch file there (permission bits can say yes and be wrong)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            return True
    except OSError:
        return False


def validate(args: argparse.Namespace) -> tuple[list[str], list[str], dict]:
    """Every user mistake reported before any model is loaded."""
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown or not datasets:
        raise ValueError(f"unknown data set {','.join(unknown) or '(none)'}: choose from {', '.join(DATASETS)}")
    variants = dict(parse_variant(spec) for spec in args.config)
    default = "plain,hf-greedy,hf-prompt-lookup,lookahead" if args.backend == "transformers" else "plain,lookahead"
    methods = [m for m in (args.methods or default).split(",") if m]
    unknown = [m for m in methods if m not in BUILTIN_METHODS and m not in variants]
    if unknown:
        raise ValueError(f"unknown method {','.join(unknown)}: choose from {', '.join(BUILTIN_METHODS)}")
    methods = list(dict.fromkeys(["plain", *methods, *variants]))
    if args.backend != "transformers" and (hf := [m for m in methods if m.startswith("hf-")]):
        raise ValueError(f"{', '.join(hf)} run on transformers only: leave them out with --backend {args.backend}")
    if getattr(args, "temperature", 0) and (hf := [m for m in methods if m.startswith("hf-")]):
        raise ValueError(f"{', '.join(hf)} run greedy only here: leave them out when sampling")
    if args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    for target in [Path(args.out) / "results.json", *([Path(args.json)] if args.json else [])]:
        if not _writable(target):
            raise ValueError(f"cannot write {target}: its directory is not writable")
    return datasets, methods, variants


def _sampling(args: argparse.Namespace) -> dict:
    """Engine options for the benchmark's sampling flags; empty when greedy."""
    return request_options(args.temperature, args.top_p, args.top_k, args.seed)


def run_bench(args: argparse.Namespace, argv: list[str]) -> int:
    datasets, methods, variants = validate(args)
    prompts = load_prompts(datasets, args.limit)

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..models import load_model

    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, device=args.device, backend=args.backend, threads=args.threads
    )
    bench = Bench(model, tokenizer, methods, variants, args.max_new_tokens, _sampling(args))
    bench.warm_up(prompts[0])
    samples = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmark", total=len(prompts))
        for index, prompt in enumerate(prompts):
            samples += bench.prompt(index, prompt)
            live = {r["method"]: r["speedup"] for r in summarize(samples, methods) if r["dataset"] == "all"}
            shown = "  ".join(f"{m} {v:.2f}x" for m, v in live.items() if m != "plain" and v)
            progress.update(task, advance=1, description=f"{prompt.dataset:>10} | {shown}")

    rows = summarize(samples, methods)
    divergences = bench.divergences(samples, prompts)
    model_name = args.model or "smollm2-135m"
    result = {
        "model": model_name,
        "command": "lookahead " + shlex.join(argv),
        "settings": {"max_new_tokens": args.max_new_tokens, "limit": args.limit, "dtype": args.dtype,
                     "backend": args.backend,
                     "sampling": _sampling(args) or "greedy",
                     "datasets": datasets, "methods": methods,
                     "configs": {name: cfg.__dict__ for name, cfg in variants.items()},
                     "lookahead": bench.engines["lookahead"].config.__dict__,
                     "draft_mode": bench.engines["lookahead"].draft_mode},
        "environment": environment(),
        "results": rows,
        "divergences": divergences,
        "samples": [
            {"dataset": s.dataset, "key": s.key, "method": s.method, "new_tokens": len(s.token_ids),
             "seconds": round(s.seconds, 4), "steps": s.steps, "draft_tokens": s.draft_tokens}
            for s in samples
        ],
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1)
    (out / "results.json").write_text(text)
    if args.json:
        Path(args.json).write_text(text)
    table = markdown_table(rows)
    if divergences:
        table += "\n\nOutputs that differ from plain decoding (plain's top-2 logit margin where they first differ):\n\n"
        table += markdown_table(divergences, DIVERGENCE_COLUMNS)
    (out / "results.md").write_text(table + "\n")
    title = f"{model_name}, {args.dtype}, {args.max_new_tokens} new tokens, {args.limit} prompts per set"
    plot_speedup(rows, out / "speedup.png", title)
    histograms: dict[str, Counter[int]] = {}
    for sample in samples:
        if sample.method not in ("plain",) and sample.steps is not None:
            histograms.setdefault(sample.method, Counter()).update(sample.accepted)
    plot_accepted(histograms, out / "accepted.png", title)
    print(table)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    """Record (with --record), then replay every --config (and the default) over the recording."""
    path = Path(args.recording)
    variants = dict(parse_variant(spec) for spec in args.config)
    if args.record:
        datasets = [d for d in args.datasets.split(",") if d]
        if args.limit < 1:
            raise ValueError(f"--limit must be at least 1, got {args.limit}")
        prompts = load_prompts(datasets, args.limit)
        if not _writable(path):
            raise ValueError(f"cannot write {path}: its directory is not writable")
        _record(args, prompts, path)
    elif not path.exists():
        raise FileNotFoundError(f"{path}: no such recording (make one with --record)")
    header, records = load_records(path)
    configs = {"default": LookaheadConfig(), **variants}
    if args.sweep:
        configs.update(sweep_configs())
    rows = []
    for name, config in configs.items():
        clock = time.perf_counter()
        rows += summarize_replay(name, config, replay(records, header, config))
        print(f"{name}: replayed in {time.perf_counter() - clock:.1f} s", file=sys.stderr)
    columns = ["config", "dataset", "prompts", "edl", "draft_tokens_per_step", "predicted_speedup"]
    table = markdown_table(rows, columns)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps({"recording": str(path), "results": rows}, indent=1))
        (out / "replay.md").write_text(table + "\n")
        if args.sweep:
            plot_sweep(rows, out / "sweep.png", f"replay of {path.name}: predicted speedup by draft size")
    print(table)
    return 0


def _record(args: argparse.Namespace, prompts, path: Path) -> None:
    import torch
    from rich.progress import Progress

    from ..engine import LookaheadEngine
    from ..models import load_model

    torch.set_num_threads(args.threads or 2)
    model, tokenizer = load_model(
        args.model, dtype=args.dtype, device=args.device, backend=args.backend, threads=args.threads or 2
    )
    engine = LookaheadEngine(model, tokenizer, LookaheadConfig(recycled=RECORDED_FOLLOWING))
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("recording plain greedy", total=len(prompts))
        record(engine, prompts, args.max_new_tokens, path, progress=lambda: progress.advance(task))
