"""`lookahead generate --compare`: the speedup of a prompt asked for the first time, and asked again.

Lookahead drafts from what its trie has seen, and a generation teaches the trie its own
answer, so the same prompt asked twice is far faster the second time. The headline is the
first-time figure: each round drafts with a fresh trie on the same model (the streamed run is
the first round). The asked-again figure is shown apart, labelled. Plain decoding runs
between them in every round, medians are reported, and a machine that was busy meanwhile (other
processes took more than QUIET of its CPU during the rounds; decoding/load.py) is named, since
its figures are noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .decoding.generation import GenerationOutput
from .decoding.load import QUIET, OthersLoad

ROUNDS = 3
"""Rounds of plain / first-time / asked-again runs: enough for a median on a shared machine."""


@dataclass(frozen=True)
class Comparison:
    """Measured runs of one prompt: plain decoding, lookahead with a fresh trie, and asked again."""

    plain: Sequence[GenerationOutput]
    first: Sequence[GenerationOutput]
    again: Sequence[GenerationOutput]
    others: float
    """The share of the machine's CPU time other processes took during the rounds (0 to 1)."""

    @property
    def identical(self) -> bool:
        """Every lookahead output equals plain decoding's."""
        want = self.plain[0].token_ids
        return all(out.token_ids == want for out in (*self.plain, *self.first, *self.again))

    @property
    def busy(self) -> bool:
        return self.others > QUIET

    def lines(self, mode: str) -> list[str]:
        plain, first, again = (_median_rate(outs) for outs in (self.plain, self.first, self.again))
        edl = statistics.median(out.stats.edl for out in self.first)
        rounds = f"median of {len(self.first)} rounds" if len(self.first) > 1 else "one round"
        lines = [
            f"first time:  plain {plain:.1f} tok/s | lookahead {first:.1f} tok/s | speedup {first / plain:.2f}x | "
            f"{edl:.2f} tokens per forward pass | {mode} | {rounds}",
            f"asked again: lookahead {again:.1f} tok/s | speedup {again / plain:.2f}x "
            "(the trie holds this answer now: what a repeated question gets)",
            f"identical to plain: {'yes' if self.identical else 'NO'}",
        ]
        if self.busy:
            taken = f"other processes took {self.others:.0%} of its CPU meanwhile"
            lines.append(f"note: the machine was busy ({taken}): these figures are noisy")
        return lines


def compare(
    first: GenerationOutput,
    plain: Callable[[], GenerationOutput],
    fresh: Callable[[], GenerationOutput],
    again: Callable[[], GenerationOutput],
    rounds: int = ROUNDS,
) -> Comparison:
    """Round 1 reuses `first` (the streamed run); each round runs plain, then a fresh trie, then asked again."""
    load = OthersLoad()
    plains, firsts, agains = [], [first], []
    for number in range(rounds):
        plains.append(plain())
        if number:
            firsts.append(fresh())
        agains.append(again())
    return Comparison(plains, firsts, agains, load.share())


def _median_rate(outputs: Sequence[GenerationOutput]) -> float:
    return statistics.median(out.stats.new_tokens / out.stats.seconds for out in outputs)
