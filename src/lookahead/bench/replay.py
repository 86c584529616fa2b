"""Drafter replay: tune the trie policy in seconds, without running the model.

Greedy output is deterministic, so once plain greedy outputs are recorded, what any drafter
setting would accept at every step follows from them: the model's choice at a draft node is
the recorded next token if the node's path matches the recording so far. Tokens per step,
draft sizes and the accepted-length histogram come out exactly as a real run would give them;
the forward-pass cost curve measured at record time turns them into a predicted speedup.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import LookaheadConfig
from ..draft import DraftTree
from ..engine import LookaheadEngine
from ..policy import CostModel, DraftPolicy, DraftSession
from ..trie import TokenTrie
from ..verify import accept_greedy
from .datasets import Prompt

_COST_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class ReplayStats:
    prompts: int = 0
    new_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted: Counter[int] = field(default_factory=Counter)
    widths: Counter[int] = field(default_factory=Counter)
    """Forward-pass widths (root + draft) → number of steps: what the cost model prices."""


def oracle_choices(tree: DraftTree, output: Sequence[int], pos: int) -> list[int]:
    """The recorded model's choice at every block index; -1 where the path left the recording."""
    on_path = [True]
    depth = [0]
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        d = depth[parent] + 1
        depth.append(d)
        on_path.append(on_path[parent] and pos + d - 1 < len(output) and output[pos + d - 1] == token)
    return [output[pos + d] if ok and pos + d < len(output) else -1 for ok, d in zip(on_path, depth, strict=True)]


def replay_one(
    session: DraftSession, prompt: Sequence[int], output: Sequence[int], max_new_tokens: int, branching: bool,
    stats: ReplayStats,
) -> list[int]:  # fmt: skip
    """Steps of one request, as the engine would take them; returns tokens accepted per step."""
    sequence = [*prompt, output[0]]
    session.learn(output[:1])
    pos = 1
    per_step = []
    while pos < len(output):
        tree = session.propose(sequence, max_new_tokens - pos, branching)
        accepted, emitted = accept_greedy(tree, oracle_choices(tree, output, pos))
        session.verified(tree, accepted)
        emitted = emitted[: len(output) - pos]
        session.learn(emitted)
        sequence += emitted
        pos += len(emitted)
        stats.steps += 1
        stats.draft_tokens += len(tree)
        stats.accepted[len(accepted)] += 1
        stats.widths[len(tree) + 1] += 1
        per_step.append(len(emitted))
    stats.prompts += 1
    stats.new_tokens += len(output)
    return per_step


def replay(records: Iterable[dict], header: dict, config: LookaheadConfig) -> dict[str, ReplayStats]:
    """All records in order with one trie (state carries across requests, as in a server)."""
    trie = TokenTrie(config.ngram_length, header["eos_ids"], config.trie_max_nodes, config.trie_half_life)
    policy = DraftPolicy(CostModel(header["cost_ms"]) if config.policy == "adaptive" else None)
    by_dataset: dict[str, ReplayStats] = {}
    for record in records:
        replay_record(trie, policy, config, header, record, by_dataset.setdefault(record["dataset"], ReplayStats()))
    return by_dataset


def replay_record(
    trie: TokenTrie, policy: DraftPolicy, config: LookaheadConfig, header: dict, record: dict, stats: ReplayStats
) -> None:
    """One recorded request drafted from `trie`, its steps added to `stats`."""
    session = DraftSession(trie, config, record["prompt_ids"], policy)
    try:
        replay_one(
            session, record["prompt_ids"], record["output_ids"], header["max_new_tokens"],
            header["draft_mode"] == "tree", stats,
        )  # fmt: skip
    finally:
        session.close()


def predicted_seconds(stats: ReplayStats, cost_ms: dict) -> float:
    """Forward time of all steps, priced by the cost curve measured at record time."""
    cost = CostModel(cost_ms)
    return sum(cost.predict(width) * count for width, count in stats.widths.items()) / 1000


def summarize_replay(
    name: str, config: LookaheadConfig, by_dataset: dict[str, ReplayStats], header: dict
) -> list[dict]:
    """Rows per data set and for all: tokens per step, draft size, speedup predicted by the cost curve."""
    total = ReplayStats()
    for stats in by_dataset.values():
        total.prompts += stats.prompts
        total.new_tokens += stats.new_tokens
        total.steps += stats.steps
        total.draft_tokens += stats.draft_tokens
        total.widths.update(stats.widths)
    plain_ms = CostModel(header["cost_ms"]).predict(1)
    rows = []
    for dataset, stats in [*by_dataset.items(), ("all", total)]:
        plain_s = (stats.new_tokens - stats.prompts) * plain_ms / 1000  # a plain step per token after the first
        rows.append(
            {
                "config": name,
                "dataset": dataset,
                "prompts": stats.prompts,
                "decoding_length": config.decoding_length,
                "branch_length": config.branch_length,
                "policy": config.policy,
                "edl": round(stats.new_tokens / stats.steps, 3),
                "draft_tokens_per_step": round(stats.draft_tokens / stats.steps, 2),
                "predicted_speedup": round(plain_s / predicted_seconds(stats, header["cost_ms"]), 3),
            }
        )
    return rows


def sweep_configs() -> dict[str, LookaheadConfig]:
    """The fixed grid the adaptive policy has to match: decoding_length x branch_length."""
    return {
        f"fixed-{d}x{b}": LookaheadConfig(decoding_length=d, branch_length=b, policy="fixed")
        for d in (4, 8, 16, 32, 64)
        for b in (4, 8, 16)
    }


# ---- recording --------------------------------------------------------------------------


def record(engine: LookaheadEngine, prompts: list[Prompt], max_new_tokens: int, path: Path, progress=None) -> None:
    """Plain greedy over `prompts`, written as JSON lines after a header with the cost curve."""
    rows = []
    for prompt in prompts:
        ids = engine.chat_ids([{"role": "user", "content": prompt.text}])
        out = engine.generate(ids, max_new_tokens=max_new_tokens, use_lookahead=False)
        rows.append({"dataset": prompt.dataset, "key": prompt.key, "prompt_ids": ids, "output_ids": out.token_ids})
        if progress:
            progress()
    header = {
        "format": "lookahead-replay/1",
        "eos_ids": sorted(engine.eos_ids),
        "max_new_tokens": max_new_tokens,
        "draft_mode": engine.draft_mode,
        "cost_ms": engine.measure_cost(),
    }
    scratch = path.with_name(path.name + ".part")
    with scratch.open("w") as out:
        for row in [header, *rows]:
            out.write(json.dumps(row) + "\n")
    scratch.replace(path)


def load_records(path: Path) -> tuple[dict, list[dict]]:
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a replay recording ({err})") from err
    if not lines or lines[0].get("format") != "lookahead-replay/1":
        raise ValueError(f"{path}: not a replay recording (no lookahead-replay/1 header)")
    return lines[0], lines[1:]
