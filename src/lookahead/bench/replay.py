"""Drafter replay: tune the trie policy in seconds, without running the model.

Greedy output is deterministic, so once plain greedy outputs are recorded, what any drafter
setting would accept at every step follows from them: the model's choice at a draft node is
the recorded next token if the node's path matches the recording so far. Tokens per step,
draft sizes and the accepted-length histogram come out exactly as a real run would give them;
the forward-pass cost curve measured at record time turns them into a predicted speedup.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import LookaheadConfig
from ..draft import DraftTree
from ..engine import LookaheadEngine
from ..kvcache import new_cache
from ..policy import DraftSession
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
    trie = TokenTrie(config.ngram_length, boundary_ids=header["eos_ids"])
    by_dataset: dict[str, ReplayStats] = {}
    for record in records:
        stats = by_dataset.setdefault(record["dataset"], ReplayStats())
        session = DraftSession(trie, config, record["prompt_ids"])
        try:
            replay_one(
                session, record["prompt_ids"], record["output_ids"], header["max_new_tokens"],
                header["draft_mode"] == "tree", stats,
            )  # fmt: skip
        finally:
            session.close()
    return by_dataset


def predicted_seconds(stats: ReplayStats, cost_ms: dict[int, float]) -> float:
    """Forward time of all steps from the measured cost curve (linear between measured widths)."""
    points = sorted((int(w), ms) for w, ms in cost_ms.items())

    def cost(width: int) -> float:
        for (w0, c0), (w1, c1) in itertools.pairwise(points):
            if width <= w1:
                return c0 + (c1 - c0) * (width - w0) / (w1 - w0)
        (w0, c0), (w1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) * (width - w1) / (w1 - w0)

    return sum(cost(width) * count for width, count in stats.widths.items()) / 1000


# ---- recording --------------------------------------------------------------------------


def measure_cost(engine: LookaheadEngine, context: Sequence[int], repeats: int = 5) -> dict[int, float]:
    """Median milliseconds of one forward pass of each width after `context` in the cache."""
    costs = {}
    with torch.inference_mode():
        cache = new_cache(engine.model)
        engine.forward(cache, list(context), 0, last_only=True)
        past = len(context)
        for width in _COST_WIDTHS:
            times = []
            for _ in range(repeats):
                block = list(context[-width:]) if width <= past else [*context] * 2
                clock = time.perf_counter()
                engine.forward(cache, block[:width], past)
                times.append((time.perf_counter() - clock) * 1000)
                for layer in cache.layers:  # drop the block again: the context stays the same
                    layer.keys = layer.keys[..., :past, :]
                    layer.values = layer.values[..., :past, :]
            costs[width] = round(statistics.median(times), 2)
    return costs


def record(engine: LookaheadEngine, prompts: list[Prompt], max_new_tokens: int, path: Path, progress=None) -> None:
    """Plain greedy over `prompts`, written as JSON lines after a header with the cost curve."""
    rows = []
    for prompt in prompts:
        ids = engine.chat_ids([{"role": "user", "content": prompt.text}])
        out = engine.generate(ids, max_new_tokens=max_new_tokens, use_lookahead=False)
        rows.append({"dataset": prompt.dataset, "key": prompt.key, "prompt_ids": ids, "output_ids": out.token_ids})
        if progress:
            progress()
    context = (rows[0]["prompt_ids"] + rows[0]["output_ids"])[:200]
    header = {
        "format": "lookahead-replay/1",
        "eos_ids": sorted(engine.eos_ids),
        "max_new_tokens": max_new_tokens,
        "draft_mode": engine.draft_mode,
        "cost_ms": measure_cost(engine, context),
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
