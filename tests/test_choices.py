import numpy as np
import pytest

from lookahead.drafting.choices import ModelChoices


def test_the_latest_choice_after_each_token_across_answers_and_pieces():
    choices = ModelChoices()
    choices.learn(None, [1, 2])
    choices.learn(2, [3])  # the next piece of the same answer: 2 was followed by 3
    choices.learn(None, [7, 2, 4])  # another answer, later: after 2 the model now chose 4
    assert [choices.choice(token) for token in (1, 2, 3, 7, 4)] == [2, 4, None, 2, None]
    assert len(choices) == 3 and choices.largest_token() == 7


def test_past_its_bound_it_forgets_the_token_chosen_after_longest_ago():
    choices = ModelChoices(most=2)
    choices.learn(None, [1, 2, 3])  # 1 -> 2, 2 -> 3
    choices.learn(None, [1, 5])  # 1 chosen after again: now the freshest
    choices.learn(None, [8, 9])  # a third token: 2 (the stalest) goes
    assert [choices.choice(token) for token in (1, 2, 8)] == [5, None, 9]


def test_a_column_round_trips_in_order_and_unsound_ones_are_refused():
    choices = ModelChoices(most=3)
    choices.learn(None, [4, 5, 6, 4, 7])
    column = choices.column()
    assert column.tolist() == [[5, 6], [6, 4], [4, 7]]  # stalest first
    loaded = ModelChoices.from_column(column, most=3)
    assert loaded.column().tolist() == column.tolist()
    for bad, why in [
        (column.astype(np.int64), "2-d int64"),
        (column[:, :1], "shape"),
        (np.array([[4, 1], [4, 2]], dtype=np.int32), "twice"),
        (np.array([[4, -1]], dtype=np.int32), "out of range"),
        (np.array([[1 << 24, 1]], dtype=np.int32), "out of range"),
        (np.array([[1, 2], [2, 3], [3, 4], [4, 5]], dtype=np.int32), "more than 3"),
    ]:
        with pytest.raises(ValueError, match=why):
            ModelChoices.from_column(bad, most=3)
