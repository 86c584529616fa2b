"""Closed batches: a list of prompts handed to `generate_batch` at once, lookahead against plain, per set and mixed.

The most common batch use is not a stream of clients (batchbench.py) but a list: N prompts
in, N answers out, the batch draining to its last row. For each batch size and each group
(N prompts of one set, or of the four sets in turn), the loop `engine.generate_batch(group,
max_batch=N)` runs is run for each method on a fresh engine (empty trie; probing and pricing
done before any clock), the two batches taking turns round by round and each timed by its
own rounds (batchbench.run_batched: a shared machine's slow spells fall on both), which goes
first swapped every pass; prefill and drain included. `--hf` adds the same through transformers:
`model.generate(custom_generate=lookahead.hf.generate)` on a left-padded batch of the mixed
group against transformers' own `model.generate` of it. `--trace` writes every forward pass
of every run (rows, tokens, predicted and observed milliseconds, expected and accepted draft
tokens, prefill) to trace.jsonl. `curves_doubted`: lookahead runs whose steps showed the cached
cost curves too dear (decoding/costs.py: CheckedCost), which the next engine measures again.

    python -m lookahead.bench.closedbench --out benchmarks/closed-smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import hf
from ..decoding.generation import Generation
from ..decoding.step import Verifier, longest_context
from ..decoding.transcript import eos_ids
from ..drafting.policy import step_width
from ..drafting.tree import DraftTree
from ..engine import LookaheadEngine
from ..models import load_model
from .batchbench import run_batched
from .datasets import load_prompts
from .report import add_model_options, markdown_table, run_record

SETS = ["code-edit", "humaneval", "gsm8k", "mtbench"]
MIXED = "mixed"
COLUMNS = ["prompts", "group", "plain_tokens_per_s", "lookahead_tokens_per_s", "ratio", "lookahead_tokens_per_step",
           "rounds", "tail_rounds", "exact_match"]  # fmt: skip


class Traced:
    """A verifier that records each forward pass: rows, tokens, the policy's prediction and the observed time."""

    def __init__(self, verifier: Verifier, engine: LookaheadEngine, log: list[dict]) -> None:
        self.verifier = verifier
        self.engine = engine
        self.log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.verifier, name)

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        clock = time.perf_counter()
        firsts = self.verifier.prefill(generations, counts)
        self.log.append({"prefill_tokens": sum(counts), "ms": round((time.perf_counter() - clock) * 1000, 1)})
        return firsts

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]):
        policy, context = self.engine.policy, longest_context(generations)
        width = step_width(trees, policy.packed)
        predicted = policy.cost.predict(width, len(trees), context) if policy.cost is not None else None
        measured = policy.cost.measured(width, len(trees), context) if policy.cost is not None else None
        verdicts, milliseconds = self.verifier.verify(generations, trees)
        self.log.append({
            "rows": len(trees), "tokens": sum(len(tree) + 1 for tree in trees), "context": context,
            "predicted_ms": predicted and round(predicted, 1), "measured_ms": measured and round(measured, 1),
            "ms": round(milliseconds, 1), "accepted": sum(len(v.accepted) for v in verdicts),
            "expected": round(sum(float(sum(tree.chances)) for tree in trees), 2),
        })  # fmt: skip
        return verdicts, milliseconds


def fresh_engine(model, tokenizer, size: int) -> LookaheadEngine:
    """An engine with an empty trie, its batching probed and priced (cached) before any clock runs."""
    engine = LookaheadEngine(model, tokenizer)
    engine.batch(size)
    return engine


def compare(model, tokenizer, group: list[list[int]], new_tokens: int, passes: int, trace: list[dict]) -> dict:
    """Plain and lookahead batches of the whole `group` on fresh engines, round by round in turn, `passes` times
    (which goes first swapped every pass); each timed by its own rounds, prefill and drain included."""
    runs: dict[str, list[dict]] = {"plain": [], "lookahead": []}
    for number in range(passes):
        order = ["plain", "lookahead"] if number % 2 == 0 else ["lookahead", "plain"]
        engines, logs = {}, {}
        for name in order:
            engine = fresh_engine(model, tokenizer, len(group))
            engine.verifier = Traced(engine.verifier, engine, logs.setdefault(name, []))
            engines[name] = (engine, name == "lookahead")
        for name, (outputs, row) in run_batched(engines, group, len(group), new_tokens, closed=True).items():
            steps = [entry for entry in logs[name] if "rows" in entry]
            trace.append({"drafts": name == "lookahead", "prompts": len(group), "passes": logs[name]})
            runs[name].append({**row, "outputs": [out.token_ids for out in outputs], "rounds": len(steps),
                               "tail_rounds": sum(entry["rows"] < len(group) for entry in steps),
                               "doubt": getattr(engines[name][0].policy.cost, "doubt", None)})  # fmt: skip
    plain, ahead = runs["plain"], runs["lookahead"]
    rate = lambda rs: sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)  # noqa: E731
    reference = plain[0]["outputs"]
    exact = [o == w for r in ahead + plain for o, w in zip(r["outputs"], reference, strict=True)]
    return {
        "plain_tokens_per_s": round(rate(plain), 2),
        "lookahead_tokens_per_s": round(rate(ahead), 2),
        "ratio": round(rate(ahead) / rate(plain), 3),
        "ratios_by_pass": [round(rate([a]) / rate([p]), 3) for a, p in zip(ahead, plain, strict=True)],
        "lookahead_tokens_per_step": round(sum(r["tokens_per_step"] for r in ahead) / len(ahead), 2),
        "rounds": round(sum(r["rounds"] for r in ahead) / len(ahead), 1),
        "plain_rounds": round(sum(r["rounds"] for r in plain) / len(plain), 1),
        "tail_rounds": round(sum(r["tail_rounds"] for r in ahead) / len(ahead), 1),
        "exact_match": round(sum(exact) / len(exact), 3),
        "curves_doubted": sum(r["doubt"] is not None for r in ahead),
    }


def compare_hf(model, tokenizer, group: list[list[int]], new_tokens: int, passes: int, reference) -> dict:
    """`model.generate` on the left-padded group: with lookahead.hf.generate (a fresh engine each pass, priced before
    the clock) against transformers' own decoding, in turn."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(map(len, group))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
    stops = eos_ids(model.generation_config, tokenizer)
    seconds: dict[bool, float] = {False: 0.0, True: 0.0}
    tokens: dict[bool, int] = {False: 0, True: 0}
    rows: dict[bool, list[list[int]]] = {}
    for number in range(passes):
        for drafts in (False, True) if number % 2 == 0 else (True, False):
            options: dict[str, Any] = {"custom_generate": hf.generate} if drafts else {}
            if drafts:
                hf.forget(model)
                hf.engine_for(model).batch(len(group))
            clock = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                     pad_token_id=pad, **options)  # fmt: skip
            seconds[drafts] += time.perf_counter() - clock
            rows[drafts] = [_until_stop(row, stops) for row in out[:, width:].tolist()]
            tokens[drafts] += sum(map(len, rows[drafts]))
    rate = {drafts: tokens[drafts] / seconds[drafts] for drafts in (False, True)}
    same = lambda got: round(sum(o == w for o, w in zip(got, reference, strict=True)) / len(reference), 3)  # noqa: E731
    return {
        "transformers_tokens_per_s": round(rate[False], 2),
        "lookahead_hf_tokens_per_s": round(rate[True], 2),
        "ratio": round(rate[True] / rate[False], 3),
        "lookahead_equals_engine_plain": same(rows[True]),
        "transformers_equals_engine_plain": same(rows[False]),
    }


def _until_stop(row: list[int], stops: set[int]) -> list[int]:
    return row[: next((i + 1 for i, token in enumerate(row) if token in stops), len(row))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_options(parser)
    parser.add_argument("--sizes", default="8,16", help="prompts per batch (comma-separated)")
    parser.add_argument(
        "--sets", default=",".join([*SETS, MIXED]), help=f"groups of one set each, and a mixed group ({MIXED})"
    )
    parser.add_argument("--passes", type=int, default=2, help="runs of each method per group, in turn")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hf", action="store_true", help="also model.generate(custom_generate=lookahead.hf.generate)")
    parser.add_argument("--trace", action="store_true", help="every forward pass of every run to trace.jsonl")
    parser.add_argument("--out", default="bench-out/closed")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    groups = [name.strip() for name in args.sets.split(",") if name.strip()]
    if unknown := sorted(set(groups) - set(SETS) - {MIXED}):
        parser.error(f"--sets: unknown {', '.join(unknown)} (known: {', '.join([*SETS, MIXED])})")
    if min(sizes) < 1 or args.passes < 1:
        parser.error("--sizes and --passes must be at least 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    fresh_engine(model, tokenizer, max(sizes))  # measures and caches the cost curves before any clock
    chat = LookaheadEngine(model, tokenizer)
    largest = max(sizes)
    by_set = {name: [chat.chat_ids([{"role": "user", "content": p.text}]) for p in load_prompts([name], largest)]
              for name in SETS}  # fmt: skip
    mixed = [by_set[name][i] for i in range(largest) for name in SETS][:largest]  # the sets in turn
    trace: list[dict] = []
    rows, hf_rows = [], []
    for size in sizes:
        for name in groups:
            group = (mixed if name == MIXED else by_set[name])[:size]
            row = {"prompts": size, "group": name, **compare(model, tokenizer, group, args.max_new_tokens,
                                                             args.passes, trace)}  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        if args.hf:
            group = mixed[:size]
            plain = chat.generate_batch(group, args.max_new_tokens, max_batch=size, use_lookahead=False)
            row = {"prompts": size, "group": MIXED, **compare_hf(model, tokenizer, group, args.max_new_tokens,
                                                                args.passes, [o.token_ids for o in plain])}  # fmt: skip
            hf_rows.append(row)
            print(row, flush=True)
    result = {
        **run_record("lookahead.bench.closedbench", args, argv),
        "results": rows,
        "hf_generate": hf_rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "closed.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(rows, COLUMNS)
    if hf_rows:
        table += "\n\n" + markdown_table(hf_rows, ["prompts", "group", *list(hf_rows[0])[2:]])
    (out / "closed.md").write_text(table + "\n")
    if args.trace:
        (out / "trace.jsonl").write_text("".join(json.dumps(run) + "\n" for run in trace))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
