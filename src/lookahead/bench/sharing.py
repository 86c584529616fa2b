"""Answer sharing replayed: tokens per step of N replicas with isolated or shared tries, without the model.

The recorded greedy answers are served round robin by N replicas, each with its own trie
and policy, one request after another; with sharing, an answer finished on one replica is
learned (`TokenTrie.learn_answer`, what a replica's sync applies) by every other replica, with
the policy's acceptance counts observed meanwhile (`Calibration.add`), before the request `lag`
requests later starts — lag 0 is a hub that delivers at once, 4 and
16 one that is a few requests behind. N = 1 is one engine with one trie: what sharing aims
to equal. Two workloads: every recorded prompt once (`unique`), and every prompt twice, the
second time in a shuffled order (`repeated`: users asking what others asked).

    python -m lookahead.bench.sharing benchmarks/replay/smollm2-135m.jsonl \
        benchmarks/replay-qwen/qwen2.5-coder-0.5b.jsonl --out benchmarks/sharing
"""

from __future__ import annotations

import argparse
import json
import random
from collections import deque
from pathlib import Path

import numpy as np

from ..config import LookaheadConfig
from ..drafting.drafter import TrieDrafting
from ..drafting.policy import Calibration
from .replay import ReplayStats, load_records, recorded_cost, replay_record
from .report import markdown_table

REPLICAS = (1, 2, 4)
LAGS = (0, 4, 16)
WORKLOADS = ("unique", "repeated")
COLUMNS = ["recording", "workload", "replicas", "tries", "lag", "requests", "tokens_per_step", "vs_one_engine",
           "worst_replica_vs_one_engine", "predicted_speedup"]  # fmt: skip


def workload(records: list[dict], kind: str, seed: int = 0) -> list[dict]:
    """The requests in arrival order: each record once, or each twice (the repeats shuffled, after the first pass)."""
    if kind == "unique":
        return list(records)
    if kind == "repeated":
        again = list(records)
        random.Random(seed).shuffle(again)
        return [*records, *again]
    raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")


def serve(header: dict, requests: list[dict], replicas: int, shared: bool, lag: int = 0) -> list[ReplayStats]:
    """Replay `requests` round robin (request t on replica t % replicas); the figures of each request."""
    if replicas < 1 or lag < 0:
        raise ValueError("replicas must be >= 1 and lag >= 0")
    config = LookaheadConfig()
    draftings = [TrieDrafting.from_config(config, header["eos_ids"], recorded_cost(header)) for _ in range(replicas)]
    served = []
    given = [tuple(np.zeros(Calibration.CELLS) for _ in range(2)) for _ in range(replicas)]  # rates already shared
    in_flight: deque[tuple[int, int, list[int], tuple]] = deque()  # (finished at request, by replica, answer, rates)
    for t, record in enumerate(requests):
        while in_flight and in_flight[0][0] + lag < t:
            _, author, answer, (sent, accepted) = in_flight.popleft()
            for i, drafting in enumerate(draftings):
                if i != author:
                    drafting.trie.learn_answer(answer)
                    drafting.policy.calibration.add(sent, accepted)
        replica = t % replicas
        stats = ReplayStats()
        replay_record(draftings[replica], header, record, stats)
        served.append(stats)
        if shared and replicas > 1:
            observed = draftings[replica].policy.calibration.observed
            rates = tuple(total - before for total, before in zip(observed, given[replica], strict=True))
            given[replica] = tuple(total.copy() for total in observed)
            in_flight.append((t, replica, record["output_ids"], rates))
    return served


def pooled(served: list[ReplayStats]) -> ReplayStats:
    total = ReplayStats()
    for stats in served:
        total.add(stats)
    return total


def tokens_per_step(served: list[ReplayStats]) -> float:
    total = pooled(served)
    return total.new_tokens / total.steps if total.steps else 0.0


def compare(name: str, header: dict, records: list[dict]) -> list[dict]:
    """Every workload x replica count x (isolated, shared at each lag) of one recording.

    A replica's figure is compared with the one engine's on the same requests (`worst_replica_vs_one_engine`:
    the replica furthest below): replicas serve different prompts, so their raw figures differ anyway.
    """
    rows = []
    for kind in WORKLOADS:
        requests = workload(records, kind)
        one = serve(header, requests, 1, shared=False)
        for replicas in REPLICAS:
            settings = [("one", 0)] if replicas == 1 else [("isolated", 0), *(("shared", lag) for lag in LAGS)]
            for tries, lag in settings:
                served = one if replicas == 1 else serve(header, requests, replicas, tries == "shared", lag)
                total = pooled(served)
                per_replica = [
                    tokens_per_step(served[r::replicas]) / tokens_per_step(one[r::replicas]) for r in range(replicas)
                ]
                rows.append(
                    {
                        "recording": name,
                        "workload": kind,
                        "replicas": replicas,
                        "tries": tries,
                        "lag": lag if tries == "shared" else None,
                        "requests": len(requests),
                        "tokens_per_step": round(tokens_per_step(served), 3),
                        "vs_one_engine": round(tokens_per_step(served) / tokens_per_step(one), 3),
                        "worst_replica_vs_one_engine": round(min(per_replica), 3),
                        "predicted_speedup": round(total.plain_ms / total.priced_ms, 3),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lookahead.bench.sharing", description=__doc__.split("\n")[0])
    parser.add_argument("recordings", nargs="+", type=Path, help="replay recordings (lookahead replay --record)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/sharing"))
    args = parser.parse_args(argv)
    rows = []
    for path in args.recordings:
        header, records = load_records(path)
        rows += compare(path.stem, header, records)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sharing.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown_table(rows, COLUMNS)
    (args.out / "sharing.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
