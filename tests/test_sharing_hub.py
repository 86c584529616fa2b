"""The answer hub as a plain class: order, exactly-once delivery, bounds, tokenizer refusal, members."""

import pytest

from lookahead.sharing import AnswerHub, TokenizerMismatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_answers_come_in_publishing_order_and_never_back_to_their_author():
    hub = AnswerHub()
    hub.publish("a", "tok", [(0, [1, 2]), (1, [3])])
    hub.publish("b", "tok", [(0, [4, 5, 6])])
    hub.publish("a", "tok", [(2, [7])])
    assert hub.since("c", hub.epoch, 0).answers == [[1, 2], [3], [4, 5, 6], [7]]
    assert hub.since("a", hub.epoch, 0).answers == [[4, 5, 6]]
    delivery = hub.since("b", hub.epoch, 0)
    assert delivery.answers == [[1, 2], [3], [7]] and delivery.position == 4 and delivery.missed == 0
    assert hub.since("b", hub.epoch, delivery.position).answers == []
    hub.publish("a", "tok", [(3, [8])])
    assert hub.since("b", hub.epoch, delivery.position).answers == [[8]]


def test_a_retried_publish_adds_nothing_but_equal_answers_of_two_replicas_both_count():
    hub = AnswerHub()
    assert hub.publish("a", None, [(0, [1, 2]), (1, [3])]) == 2
    assert hub.publish("a", None, [(1, [3]), (0, [1, 2])]) == 0  # the reply was lost; the batch is sent again
    assert hub.publish("a", None, [(1, [3]), (2, [9])]) == 1
    assert hub.publish("b", None, [(0, [1, 2])]) == 1  # another user got the same answer
    assert hub.publish("b", None, [(1, [])]) == 0  # an empty answer is numbered but not kept
    assert hub.since("c", hub.epoch, 0).answers == [[1, 2], [3], [9], [1, 2]]


def test_the_log_is_bounded_and_a_late_reader_is_told_what_it_missed():
    hub = AnswerHub(max_answers=3)
    hub.publish("a", None, [(i, [i + 10]) for i in range(5)])
    delivery = hub.since("b", hub.epoch, 0)
    assert delivery.answers == [[12], [13], [14]] and delivery.missed == 2 and delivery.position == 5
    assert hub.since("b", hub.epoch, 3).missed == 0
    by_tokens = AnswerHub(max_tokens=5)
    by_tokens.publish("a", None, [(0, [1, 1, 1]), (1, [2, 2]), (2, [3, 3])])
    assert by_tokens.since("b", by_tokens.epoch, 0).answers == [[2, 2], [3, 3]]
    assert by_tokens.stats()["tokens"] == 4 and by_tokens.stats()["dropped"] == 1
    with pytest.raises(ValueError):
        AnswerHub(max_answers=0)


def test_answers_in_another_tokenizers_ids_are_refused():
    hub = AnswerHub()
    hub.join("a", "vocab-one")
    with pytest.raises(TokenizerMismatch, match="another tokenizer"):
        hub.publish("b", "vocab-two", [(0, [1])])
    with pytest.raises(TokenizerMismatch):
        hub.join("b", "vocab-two")
    assert hub.since("c", hub.epoch, 0).answers == []
    assert hub.publish("c", "vocab-one", [(0, [1])]) == 1


def test_a_reader_of_another_epoch_starts_at_the_beginning():
    hub = AnswerHub()
    hub.publish("a", None, [(0, [1]), (1, [2])])
    assert hub.since("b", "an older hub", 2).answers == [[1], [2]]
    assert hub.since("b", None, 2).answers == [[1], [2]]


def test_members_saver_and_the_last_to_leave():
    clock = Clock()
    hub = AnswerHub(member_timeout_s=10, clock=clock)
    assert hub.join("a", None) == (hub.epoch, 0)
    clock.now = 1
    hub.join("b", None)
    assert hub.live() == ["a", "b"] and hub.saver() == "a"
    clock.now = 10.5  # a silent for 10.5 s, b for 9.5 s
    assert hub.live() == ["b"] and hub.saver() == "b"
    hub.since("a", hub.epoch, 0)  # a is heard again and keeps its place
    assert hub.saver() == "a"
    assert not hub.leave("a")  # b is still live
    assert hub.leave("b")
    assert hub.saver() is None


def test_a_save_position_is_where_a_restarted_replica_reads_on():
    hub = AnswerHub()
    hub.publish("a", None, [(0, [1]), (1, [2])])
    hub.saved("a", 2)
    hub.publish("b", None, [(0, [3])])
    epoch, position = hub.join("a-restarted", None)
    assert hub.since("a-restarted", epoch, position).answers == [[3]]
    hub.saved("a", 99)  # never past the end of the log
    assert hub.saved_through == 3


def test_metrics_of_live_members_only():
    clock = Clock()
    hub = AnswerHub(member_timeout_s=5, clock=clock)
    hub.post_metrics("a", "a 1\n")
    clock.now = 3
    hub.post_metrics("b", "b 2\n")
    assert hub.metrics() == {"a": "a 1\n", "b": "b 2\n"}
    clock.now = 6
    assert hub.metrics() == {"b": "b 2\n"}


def test_acceptance_totals_of_the_others_past_members_included():
    hub = AnswerHub()
    assert hub.exchange_rates("a", [1.0, 2.0], [0.0, 1.0]) == ([0.0, 0.0], [0.0, 0.0])
    hub.exchange_rates("b", [3.0, 0.0], [1.0, 0.0])
    hub.leave("b")  # what b observed still counts for the others
    assert hub.exchange_rates("c", [0.0, 0.0], [0.0, 0.0]) == ([4.0, 2.0], [1.0, 1.0])
    assert hub.exchange_rates("a", [2.0, 2.0], [1.0, 1.0]) == ([3.0, 0.0], [1.0, 0.0])


def test_totals_of_a_calibration_with_other_cells_are_left_out():
    hub = AnswerHub()
    hub.exchange_rates("old", [5.0, 5.0, 5.0], [1.0, 1.0, 1.0])  # another version's cells
    assert hub.exchange_rates("new", [1.0, 2.0], [0.0, 1.0]) == ([0.0, 0.0], [0.0, 0.0])
    assert hub.exchange_rates("old", [5.0, 5.0, 5.0], [1.0, 1.0, 1.0]) == ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
