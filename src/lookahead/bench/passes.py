"""What one forward pass of each width costs: the model's own linear layers against packed ones, side by side.

The engine's passes as the cost curves time them (one row after a cached context), the two kinds
of linear layers taking turns width by width, the fastest of `--repeats` of each; every width
also as a multiple of that kind's one-token pass (what a draft of that many tokens costs over a
plain step).

    python -m lookahead.bench.passes --contexts 128,1024 --out benchmarks/passes-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..backends.transformers.capability import check_direct_decoder
from ..backends.transformers.forward import ModelForward
from ..backends.transformers.kernels import time_both
from ..backends.transformers.linears import PackedLinears
from ..models import load_model
from .report import add_model_options, markdown_table, run_record

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
COLUMNS = ["context", "width", "model_ms", "packed_ms", "model_vs_1", "packed_vs_1", "packed_speedup"]


def pass_rows(forward: ModelForward, packed: PackedLinears, context: int, repeats: int) -> list[dict]:
    """One row per width: the fastest pass of each kind, and each as a multiple of that kind's one-token pass."""
    best = time_both(forward, packed, WIDTHS, context, repeats)
    model, fast = best["model"], best["packed"]
    return [
        {
            "context": context,
            "width": width,
            "model_ms": round(model[width], 2),
            "packed_ms": round(fast[width], 2),
            "model_vs_1": round(model[width] / model[1], 2),
            "packed_vs_1": round(fast[width] / fast[1], 2),
            "packed_speedup": round(model[width] / fast[width], 2),
        }
        for width in WIDTHS
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--contexts", default="128,1024", help="cached tokens before the pass (comma-separated)")
    parser.add_argument("--repeats", type=int, default=7, help="passes of each kind and width; the fastest counts")
    parser.add_argument("--out", default="bench-out/passes")
    parser.add_argument(
        "--model-forward", action="store_true", help="passes through the model's forward, not the direct decoder"
    )
    args = parser.parse_args(argv)
    contexts = [int(context) for context in args.contexts.split(",")]
    if args.repeats < 1 or min(contexts) < 1:
        parser.error("--repeats and --contexts must be at least 1")
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    forward = ModelForward(model)
    if not args.model_forward:
        check_direct_decoder(forward)  # as the engine's passes run
    packed = PackedLinears(model)
    if not packed:
        parser.error(f"no linear layer of this model can be packed ({args.dtype} on {args.device})")
    rows = []
    for context in contexts:
        rows += pass_rows(forward, packed, context, args.repeats)
        print(markdown_table(rows[-len(WIDTHS) :], COLUMNS), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {**run_record("lookahead.bench.passes", args, argv), "direct_layers": forward.decoder is not None}
    record["passes"] = rows
    (out / "passes.json").write_text(json.dumps(record, indent=1))
    (out / "passes.md").write_text(
        f"`{record['command']}`\n\nMilliseconds of one pass of one row, fastest of {args.repeats}; "
        f"`*_vs_1`: against that kind's one-token pass.\n\n{markdown_table(rows, COLUMNS)}\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
