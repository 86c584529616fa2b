import numpy as np
import pytest

from lookahead.decoding.ends import Ends, Pace, chances_last
from lookahead.decoding.generation import Generation
from lookahead.decoding.transcript import Transcript


def test_the_worked_example():
    last = chances_last([100 / 1.1, 100 / 1.1, 100 / 3.5], [27.3, 27.3, 8.6])
    assert last == pytest.approx([0.4996, 0.4996, 0.0008], abs=1e-4)


def test_chances_of_ending_last_sum_to_one_and_follow_the_remaining_steps():
    last = chances_last([100, 95, 90, 70], [15, 14, 13, 10])
    assert last.sum() == pytest.approx(1.0)
    assert list(last) == sorted(last, reverse=True)
    assert chances_last([40], [3]) == pytest.approx([1.0])
    assert chances_last([50] * 8, [4] * 8) == pytest.approx([1 / 8] * 8)
    assert chances_last([100, 99], [0.1, 0.1])[0] > 0.85, "a step apart, sure of both: the longer ends last"


def test_a_pace_starts_at_a_token_a_step_and_follows_recent_steps():
    pace = Pace()
    assert (pace.mean, pace.variance) == (1.0, 0.0)
    for _ in range(60):
        pace.add(4)
    assert pace.mean == pytest.approx(4.0, abs=0.2)
    for _ in range(60):
        pace.add(1)
    assert pace.mean == pytest.approx(1.0, abs=0.2), "a copy that ended no longer counts"
    for tokens in [1, 5] * 30:
        pace.add(tokens)
    assert pace.variance == pytest.approx(4.0, rel=0.2)


def _generation(room: int) -> Generation:
    return Generation([1, 2, 3], room, Transcript(lambda ids: "", room, frozenset(), ()))


def test_the_row_with_most_steps_to_go_ends_last():
    copying, chatting, short = _generation(128), _generation(128), _generation(20)
    ends = Ends()
    for _ in range(20):
        ends.stepped(copying, 4)
        ends.stepped(chatting, 1)
        ends.stepped(short, 1)
    last = ends.last([copying, chatting, short])
    assert last[1] > 0.95 and last[0] < 0.05 and last[2] < 0.01
    ends.forget(chatting)
    assert np.argmax(ends.last([copying, short])) == 0
