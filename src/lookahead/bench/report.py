"""Tables, plots and the BENCHMARKS.md page from the runner's results."""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from collections import Counter
from pathlib import Path

_COLUMNS = ["dataset", "method", "prompts", "new_tokens", "tokens_per_s", "edl", "draft_tokens_per_step", "speedup",
            "exact_match"]  # fmt: skip


def environment() -> dict[str, str]:
    """Machine and software versions, recorded next to every result."""
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "torch_threads": str(torch.get_num_threads()),
        "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def run_record(module: str, args: argparse.Namespace, argv: list[str] | None) -> dict:
    """What every benchmark's result file starts with: the command that made it (to rerun as is), the model, the
    machine and the settings."""
    return {
        "command": f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv),
        "model": getattr(args, "model", None) or "smollm2-135m",
        "environment": environment(),
        "settings": vars(args),
    }


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark script takes for its model: --model, --device, --dtype, --threads."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)


DIVERGENCE_COLUMNS = ["dataset", "prompt", "method", "position", "reference_margin"]


def markdown_table(rows: list[dict], columns: list[str] = _COLUMNS) -> str:
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(col)) for col in columns) + " |" for row in rows]
    return "\n".join(lines)


def _pyplot():
    """pyplot on the file-only backend: plots are written, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars: speedup over plain decoding per data set and method."""
    plt = _pyplot()

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(datasets)), 4))
    for i, method in enumerate(methods):
        values = [
            next((r["speedup"] or 0 for r in rows if r["dataset"] == d and r["method"] == method), 0) for d in datasets
        ]
        bars = ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over plain greedy (x)")
    _save(plt, fig, ax, path, title)


def plot_sweep(rows: list[dict], path: Path, title: str) -> None:
    """Per data set: speedup against decoding_length, a line per fixed branch_length, adaptive dashed."""
    plt = _pyplot()

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(3.2 * len(datasets), 3.4), sharey=True, squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        mine = [r for r in rows if r["dataset"] == dataset]
        for branch in sorted({r["branch_length"] for r in mine if r["policy"] == "fixed"}):
            line = sorted((r["decoding_length"], r["predicted_speedup"]) for r in mine
                          if r["policy"] == "fixed" and r["branch_length"] == branch)  # fmt: skip
            ax.plot(*zip(*line, strict=True), marker="o", markersize=3, label=f"fixed, depth {branch}")
        for r in mine:
            if r["policy"] == "adaptive":
                ax.axhline(r["predicted_speedup"], linestyle="--", color="black", linewidth=1,
                           label=f"adaptive ({r['config']})")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_title(dataset, fontsize=9)
        ax.set_xlabel("decoding_length (nodes)")
    axes[0][0].set_ylabel("predicted speedup (x)")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accepted(histograms: dict[str, Counter[int]], path: Path, title: str) -> None:
    """Share of steps by draft tokens accepted, per lookahead method."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for method, counts in histograms.items():
        total = sum(counts.values()) or 1
        xs = range(max(counts, default=0) + 1)
        ax.plot(list(xs), [counts.get(x, 0) / total for x in xs], marker="o", markersize=3, label=method)
    ax.set_xlabel("draft tokens accepted in a step")
    ax.set_ylabel("share of steps")
    _save(plt, fig, ax, path, title)


def _sampling_title(sampling: dict | str | None) -> str:
    """', sampling (temperature 0.7, top_p 0.9)' for a sampled run, nothing for a greedy one."""
    if not isinstance(sampling, dict):
        return ""
    shown = ", ".join(f"{k} {v}" for k, v in sampling.items() if k in ("temperature", "top_p", "top_k") and v)
    return f", sampling ({shown})"


def _divergence_lines(divergences: list[dict] | None) -> list[str]:
    """The outputs that differ from plain decoding, with plain's top-2 margin there (none: nothing)."""
    if not divergences:
        return []
    return ["Outputs that differ from plain decoding (plain's top-2 logit margin where they first differ):", "",
            markdown_table(divergences, DIVERGENCE_COLUMNS), ""]  # fmt: skip


def write_page(result_files: list[Path], notes: Path | None, out: Path) -> None:
    """BENCHMARKS.md: every result set with its command, environment, table and plots."""
    parts = ["# Benchmarks", "", "Generated by `make bench` (and `make bench-full` for the larger model); "
             "speedup = total plain-greedy time / total method time in the same run, methods interleaved per "
             "prompt; `exact_match` = share of prompts whose tokens equal plain greedy decoding.", ""]  # fmt: skip
    if notes and notes.exists():
        parts += [notes.read_text().strip(), ""]
    for file in result_files:
        result = json.loads(file.read_text())
        env = result["environment"]
        rel = file.parent.relative_to(out.parent) if file.is_relative_to(out.parent) else file.parent
        parts += [
            f"## {result['model']}{_sampling_title(result['settings'].get('sampling'))}",
            "",
            f"Command: `{result['command']}`",
            "",
            f"{env['device']}, {env['machine']}, {env['torch_threads']} torch threads; Python {env['python']}, "
            f"torch {env['torch']}, transformers {env['transformers']}; {result['settings']['max_new_tokens']} new "
            f"tokens, {result['settings']['limit']} prompts per set, {result['settings']['dtype']}.",
            "",
            markdown_table(result["results"]),
            "",
            *_divergence_lines(result.get("divergences")),
            f"![speedup]({rel}/speedup.png)",
            f"![accepted tokens per step]({rel}/accepted.png)",
            "",
        ]
    out.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    """python -m lookahead.bench.report OUT.md NOTES.md RESULTS.json..."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    write_page([Path(a) for a in args[2:]], Path(args[1]), Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
