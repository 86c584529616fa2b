"""Closed batches replayed from recorded answers: a batch policy's cost in seconds, without the clock's noise.

A closed batch on a shared CPU swings from one pass to the next (closedbench.py) by more
than most policy changes move it. Greedy output is deterministic, so the answers
recorded by `lookahead replay --record` fix what every row emits; this runs the engine's own
`Batch` and step over groups of them — each row verified by its recording, every step priced
by this machine's cost curves for one row and for batches (the model is loaded only to read
them: measured once and cached) — and adds the drafting work a row costs each step (measured
with the model; `--overhead-ms`). Groups: every window of N recorded prompts of one set, and
the sets in turn; batched plain decoding against lookahead as `generate_batch` runs it
(closed) and as a stream of requests would value its rows (open).

    python -m lookahead.bench.closedreplay benchmarks/replay/smollm2-135m.jsonl --size 8
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import LookaheadConfig
from ..decoding.batch import Batch
from ..decoding.generation import Generation
from ..decoding.step import Priced, Verdict
from ..decoding.transcript import Transcript
from ..drafting.drafter import TrieDrafting
from ..drafting.policy import CostModel
from ..drafting.tree import DraftTree
from ..engine import LookaheadEngine
from ..models import load_model
from .replay import RecordingVerifier, load_records
from .report import add_model_options, markdown_table, run_record

OVERHEAD_MS = 0.47
"""Drafting work a row costs a step beside the forward pass (proposing, learning, fitting), as measured for the
bundled model on 2 cores (benchmarks/NOTES.md, closed batches)."""
COLUMNS = ["group", "batches", "plain_s", "closed_s", "closed", "open", "closed_rounds", "plain_rounds"]


class RecordedRows:
    """Each row of a batch verified by its own recording (replay.RecordingVerifier), all in one priced step."""

    batched = True

    def __init__(self, branching: bool) -> None:
        self.branching = branching
        self._rows: dict[Generation, RecordingVerifier] = {}

    def add(self, generation: Generation, record: dict) -> None:
        self._rows[generation] = RecordingVerifier(record["output_ids"], self.branching, record.get("following", ()))

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        return [self._rows[g].prefill([g], [count])[0] for g, count in zip(generations, counts, strict=True)]

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        verdicts = [self._rows[g].verify([g], [tree])[0][0] for g, tree in zip(generations, trees, strict=True)]
        return verdicts, 0.0

    def max_leaves(self, generation: Generation) -> int:
        return self._rows[generation].max_leaves(generation)

    def join(self, generation: Generation) -> None:
        pass

    def leave(self, generation: Generation) -> None:
        pass


def run(
    group: list[dict],
    header: dict,
    measured: CostModel,
    drafts: bool,
    closed: bool,
    overhead_ms: float,
    config: LookaheadConfig | None = None,
    packed: bool = True,
) -> dict:
    """One closed batch of the recorded `group`: its priced milliseconds and rounds (`packed`: rows pay for their own
    blocks, else every row for the widest)."""
    rows = RecordedRows(header["draft_mode"] == "tree")
    verifier = Priced(rows, measured.measurement(), packed=packed)  # the clock's stand-in
    config = config or LookaheadConfig()
    drafting = TrieDrafting.from_config(config, header["eos_ids"], measured.measurement()) if drafts else None
    if drafting is not None:
        drafting.policy.packed = packed
    batch = Batch(verifier, drafting, max_batch=len(group), closed=closed)
    generations = []
    for record in group:
        transcript = Transcript(lambda ids: "", header["max_new_tokens"], frozenset(header["eos_ids"]), ())
        generation = Generation(record["prompt_ids"], header["max_new_tokens"], transcript)
        rows.add(generation, record)
        batch.add(generation)
        generations.append(generation)
    rounds = row_steps = 0
    while batch:
        running = len(batch.running)
        batch.step()
        rounds += running > 0
        row_steps += running
    for generation, record in zip(generations, group, strict=True):
        if generation.transcript.tokens != record["output_ids"]:
            raise ValueError(f"record {record.get('key')!r}: the replayed batch does not reproduce it")
    return {"ms": verifier.spent_ms + (row_steps * overhead_ms if drafts else 0.0), "rounds": rounds}


def groups(records: list[dict], size: int) -> dict[str, list[list[dict]]]:
    """Every window of `size` recorded prompts of each set, and of the sets in turn (three orders)."""
    by_set: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_set[record["dataset"]].append(record)
    found = {name: [rows[i : i + size] for i in range(len(rows) - size + 1)] for name, rows in by_set.items()}
    names = sorted(by_set)
    mixed = []
    for shift in range(min(3, len(names))):
        order = names[shift:] + names[:shift]
        turns = [
            by_set[name][i] for i in range(max(map(len, by_set.values()))) for name in order if i < len(by_set[name])
        ]
        if len(turns) >= size:
            mixed.append(turns[:size])
    return {name: windows for name, windows in {**found, "mixed": mixed}.items() if windows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", help="a recording of `lookahead replay --record`")
    add_model_options(parser)
    parser.add_argument("--size", type=int, default=8, help="prompts per closed batch")
    parser.add_argument("--overhead-ms", type=float, default=OVERHEAD_MS, help="drafting work a row costs a step")
    parser.add_argument("--out", default="bench-out/closed-replay")
    args = parser.parse_args(argv)
    if args.size < 2:
        parser.error("--size must be at least 2")
    header, records = load_records(Path(args.records))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    engine = LookaheadEngine(model, tokenizer)
    engine.batch(args.size)  # measures (or reads) this machine's batched cost curves
    measured = engine.policy.cost
    assert measured is not None
    found = groups(records, args.size)
    if not found:
        parser.error(f"--size {args.size}: the recording has fewer prompts than that")
    rows = []
    for name, batches in found.items():
        spent: dict[str, float] = defaultdict(float)
        for group in batches:
            for method, drafts, closed in (("plain", False, False), ("closed", True, True), ("open", True, False)):
                result = run(group, header, measured, drafts, closed, args.overhead_ms, engine.config,
                             engine.policy.packed)  # fmt: skip
                spent[f"{method}_ms"] += result["ms"]
                spent[f"{method}_rounds"] += result["rounds"]
        rows.append({
            "group": name, "batches": len(batches), "plain_s": round(spent["plain_ms"] / 1000, 2),
            "closed_s": round(spent["closed_ms"] / 1000, 2), "closed": round(spent["plain_ms"] / spent["closed_ms"], 3),
            "open": round(spent["plain_ms"] / spent["open_ms"], 3),
            "closed_rounds": round(spent["closed_rounds"] / len(batches), 1),
            "plain_rounds": round(spent["plain_rounds"] / len(batches), 1),
        })  # fmt: skip
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {**run_record("lookahead.bench.closedreplay", args, argv), "results": rows}
    (out / "closed-replay.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown_table(rows, COLUMNS)
    (out / "closed-replay.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
