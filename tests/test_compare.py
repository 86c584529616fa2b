"""The --compare report: first-time and asked-again figures come from the measured runs, in the right order."""

from itertools import count

from lookahead.compare import Comparison, compare
from lookahead.decoding.generation import GenerationOutput, GenerationStats


def _out(tokens: list[int], seconds: float, steps: int) -> GenerationOutput:
    stats = GenerationStats(steps=steps, new_tokens=len(tokens), forward_s=seconds)
    return GenerationOutput(tokens, "", stats, "length")


def test_round_one_reuses_the_streamed_run_and_every_round_runs_plain_then_fresh_then_again(monkeypatch):
    calls, clock = [], count()
    monkeypatch.setattr("lookahead.compare.OthersLoad.share", lambda self: 0.05)

    def run(kind: str, seconds: float):
        def go():
            calls.append((kind, next(clock)))
            return _out([1] * 12, seconds, 6)

        return go

    result = compare(_out([1] * 12, 1.0, 4), run("plain", 3.0), run("fresh", 2.0), run("again", 0.5), rounds=3)
    assert [kind for kind, _ in calls] == ["plain", "again", "plain", "fresh", "again", "plain", "fresh", "again"]
    assert len(result.plain) == len(result.first) == len(result.again) == 3
    first, again, same = result.lines("tree drafts")
    assert "plain 4.0 tok/s" in first and "lookahead 6.0 tok/s" in first and "speedup 1.50x" in first
    assert "2.00 tokens per forward pass" in first and "median of 3 rounds" in first
    assert again.startswith("asked again: lookahead 24.0 tok/s | speedup 6.00x")
    assert same == "identical to plain: yes" and result.identical and not result.busy


def test_a_busy_machine_and_a_differing_output_are_said():
    plain, other = _out([1, 2, 3], 1.0, 3), _out([1, 2, 4], 0.5, 2)
    result = Comparison([plain], [other], [plain], others=0.4)
    assert not result.identical
    lines = result.lines("chain drafts")
    assert "one round" in lines[0]
    assert lines[2] == "identical to plain: NO"
    assert lines[3] == (
        "note: the machine was busy (other processes took 40% of its CPU meanwhile): these figures are noisy"
    )
