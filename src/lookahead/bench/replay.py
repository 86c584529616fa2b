"""Drafter replay: tune the trie policy in seconds, without running the model.

Greedy output is deterministic, so once plain greedy outputs are recorded, what any drafter
setting would accept at every step follows from them: the model's choice at a draft node is
the recorded next token if the node's path matches the recording so far. The replay runs the
engine's own step loop (decoding/step.py) with a RecordingVerifier in the model's place, so
tokens per step, draft sizes and the accepted-length histogram come out exactly as a real
run gives them; the forward-pass cost curve measured at record time prices every step, for
the adaptive policy as it runs and for the predicted speedup at the end.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..config import LookaheadConfig
from ..decoding.batch import decode
from ..decoding.generation import Generation, GenerationStats
from ..decoding.step import Priced, Verdict
from ..decoding.transcript import Transcript
from ..decoding.verify import accept_greedy
from ..drafting.drafter import TrieDrafting
from ..drafting.policy import CostModel
from ..drafting.tree import DraftTree
from .datasets import Prompt

if TYPE_CHECKING:
    from ..engine import LookaheadEngine


@dataclass
class ReplayStats:
    prompts: int = 0
    new_tokens: int = 0
    steps: int = 0
    draft_tokens: int = 0
    accepted: Counter[int] = field(default_factory=Counter)
    widths: Counter[int] = field(default_factory=Counter)
    """Forward-pass widths (root + draft) → number of steps."""
    priced_ms: float = 0.0
    """The steps' forward passes, priced by the recording's cost curves at each step's context."""
    plain_ms: float = 0.0
    """What plain decoding's steps would cost for the same tokens, priced the same way."""

    @classmethod
    def of(cls, stats: GenerationStats, priced_ms: float = 0.0, plain_ms: float = 0.0) -> ReplayStats:
        """The figures of one replayed generation."""
        widths = Counter({sent + 1: steps for sent, steps in stats.sent_histogram.items()})
        accepted = Counter(stats.accepted_histogram)
        return cls(1, stats.new_tokens, stats.steps, stats.draft_tokens, accepted, widths, priced_ms, plain_ms)

    def add(self, other: ReplayStats) -> None:
        self.prompts += other.prompts
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted.update(other.accepted)
        self.widths.update(other.widths)
        self.priced_ms += other.priced_ms
        self.plain_ms += other.plain_ms


def oracle_choices(tree: DraftTree, output: Sequence[int], pos: int) -> list[int]:
    """The recorded model's choice at every block index; -1 where the path left the recording."""
    on_path = [True]
    depth = [0]
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        d = depth[parent] + 1
        depth.append(d)
        on_path.append(on_path[parent] and pos + d - 1 < len(output) and output[pos + d - 1] == token)
    return [output[pos + d] if ok and pos + d < len(output) else -1 for ok, d in zip(on_path, depth, strict=True)]


class RecordingVerifier:
    """Verification by a recorded greedy output instead of the model: the step's other half in a replay.

    A recording that kept the model's likeliest tokens at each position (`following[i]`: at
    the position that chose output[i + 1]) gives them with each verdict along the kept path, and
    -1 rows at the nodes turned down (plain decoding never computed what follows those).
    """

    batched = True

    def __init__(self, output: Sequence[int], branching: bool, following: Sequence[Sequence[int]] = ()) -> None:
        self.output = output
        self.branching = branching
        self.following = following

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        for generation, count in zip(generations, counts, strict=True):
            generation.prefilled += count
        return [self.output[0] if g.prefilled == len(g.prompt) else None for g in generations]

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        verdicts = []
        for generation, tree in zip(generations, trees, strict=True):
            emitted = len(generation.tokens) - len(generation.prompt)
            accepted, tokens = accept_greedy(tree, oracle_choices(tree, self.output, emitted))
            verdicts.append(Verdict(accepted, tokens, self._rows(tree, accepted, emitted)))
        return verdicts, 0.0  # the time is the cost model's: see Priced

    def _rows(self, tree: DraftTree, accepted: list[int], emitted: int) -> np.ndarray | None:
        """The verdict's `following`: the recorded rows along the kept path, -1 at the nodes turned down (plain
        decoding never computed what the model expects after them)."""
        recorded = self.following[emitted - 1 : emitted + len(accepted)]
        if not len(recorded):
            return None
        rows = np.full((len(tree) + 1, len(recorded[0])), -1, dtype=np.int32)
        rows[[0, *accepted][: len(recorded)]] = recorded
        return rows

    def max_leaves(self, generation: Generation) -> int:
        return 1 << 30 if self.branching else 1  # a recording limits no leaves

    def join(self, generation: Generation) -> None:
        pass

    def leave(self, generation: Generation) -> None:
        pass


def replay(records: Iterable[dict], header: dict, config: LookaheadConfig) -> dict[str, ReplayStats]:
    """All records in order with one trie (state carries across requests, as in a server)."""
    drafting = TrieDrafting.from_config(config, header["eos_ids"], recorded_cost(header))
    by_dataset: dict[str, ReplayStats] = {}
    for record in records:
        replay_record(drafting, header, record, by_dataset.setdefault(record["dataset"], ReplayStats()))
    return by_dataset


def replay_record(drafting: TrieDrafting, header: dict, record: dict, stats: ReplayStats) -> None:
    """One recorded request drafted through `drafting`, stepped exactly as the engine steps; added to `stats`.

    Each step is priced by the cost curve measured at record time, and the policy learns
    from those times as it does from a real run's clock.
    """
    output, prompt = record["output_ids"], record["prompt_ids"]
    transcript = Transcript(lambda ids: "", header["max_new_tokens"], frozenset(header["eos_ids"]), ())
    generation = Generation(prompt, header["max_new_tokens"], transcript)
    cost = recorded_cost(header)
    recording = RecordingVerifier(output, header["draft_mode"] == "tree", record.get("following", ()))
    verifier = Priced(recording, cost)
    for _ in decode(generation, verifier, drafting):
        pass
    if transcript.tokens != output:
        raise ValueError(f"record {record.get('key')!r}: its output does not end at a stop of the recording's settings")
    plain_ms = sum(cost.predict(1, context=len(prompt) + i) for i in range(len(output) - 1))
    stats.add(ReplayStats.of(generation.stats, verifier.spent_ms, plain_ms))


def recorded_cost(header: dict) -> CostModel:
    """The cost curves measured at record time (one-row curves at longer contexts, if recorded)."""
    return CostModel(header["cost_ms"], contexts=header.get("cost_by_context"))


def summarize_replay(name: str, config: LookaheadConfig, by_dataset: dict[str, ReplayStats]) -> list[dict]:
    """Rows per data set and for all: tokens per step, draft size, speedup predicted by the cost curves."""
    total = ReplayStats()
    for stats in by_dataset.values():
        total.add(stats)
    rows = []
    for dataset, stats in [*by_dataset.items(), ("all", total)]:
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
                "predicted_speedup": round(stats.plain_ms / stats.priced_ms, 3),
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


RECORDED_FOLLOWING = 8
"""The model's likeliest tokens a recording keeps per step (so replays can try recycled drafts up to this width)."""


class _Listener:
    """A drafter that drafts nothing (so decoding is plain) and keeps the model's likeliest tokens of every step."""

    def __init__(self) -> None:
        self.following: list[list[int]] = []

    def propose(
        self, context: Sequence[int], room: int, branching: bool, alone: bool = False, least: float = 0.0
    ) -> DraftTree:
        return DraftTree()

    def verified(self, tree: DraftTree, accepted: Sequence[int], following: np.ndarray | None = None) -> None:
        if following is not None:
            self.following.append(following[0].tolist())

    def learn(self, tokens: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


class _Listening:
    """Drafting by one _Listener per request: plain decoding that hears every verdict."""

    def __init__(self) -> None:
        self.listener = _Listener()

    def open(self, prompt: Sequence[int]) -> _Listener:
        self.listener = _Listener()
        return self.listener

    def fit(self, trees: Sequence[DraftTree], context: int, last: Sequence[float] | None = None) -> list[DraftTree]:
        return list(trees)

    def least(self, rows: int, context: int, last: Sequence[float] | None = None) -> list[float] | None:
        return None

    def observe(self, trees: Sequence[DraftTree], milliseconds: float, context: int) -> None:
        pass


def record(engine: LookaheadEngine, prompts: list[Prompt], max_new_tokens: int, path: Path, progress=None) -> None:
    """Plain greedy over `prompts`, written as JSON lines after a header with the cost curve.

    Each record keeps, where the engine gives them (an engine made with LookaheadConfig(recycled=
    RECORDED_FOLLOWING)), the model's likeliest tokens at every step, so that recycled drafts
    replay as they run.
    """
    from ..decoding.costs import measure_contexts, measure_cost, measuring_passes

    rows = []
    for prompt in prompts:
        ids = engine.chat_ids([{"role": "user", "content": prompt.text}])
        generation, listening = engine.prepare(ids, max_new_tokens), _Listening()
        for _ in decode(generation, engine.verifier, listening):
            pass
        output = generation.output().token_ids
        row = {"dataset": prompt.dataset, "key": prompt.key, "prompt_ids": ids, "output_ids": output}
        rows.append(row | ({"following": listening.listener.following} if listening.listener.following else {}))
        if progress:
            progress()
    longest = max(len(row["prompt_ids"]) + len(row["output_ids"]) for row in rows)
    header = {
        "format": "lookahead-replay/1",
        "eos_ids": sorted(engine.eos_ids),
        "max_new_tokens": max_new_tokens,
        "draft_mode": engine.draft_mode,
        "cost_ms": measure_cost(meter := engine.backend.meter(), repeats=(passes := measuring_passes())),
        "cost_by_context": measure_contexts(meter, longest, passes),
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
