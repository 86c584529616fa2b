"""A replica's sharing rounds: applied answers equal local learning, and a hub that fails costs only drafts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead import TokenTrie
from lookahead.sharing import AnswerHub, TrieSync

answers = st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=40), min_size=1, max_size=8)


def columns(trie: TokenTrie) -> dict[str, np.ndarray]:
    return trie._shared.export()


def learned_locally(served: list[list[int]], cuts: list[int]) -> TokenTrie:
    """One engine's trie after generating `served`, each answer arriving in steps as decoding emits it."""
    trie = TokenTrie(6, boundary_ids=[2])
    for i, answer in enumerate(served):
        request = object()
        step = max(1, cuts[i % len(cuts)])
        for start in range(0, len(answer), step):
            trie.observe(request, answer[start : start + step])
        trie.finish(request)
    return trie


@settings(max_examples=40, deadline=None)
@given(answers, st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_applying_the_others_answers_equals_learning_them_locally(served, cuts):
    hub = AnswerHub()
    author = TrieSync(TokenTrie(6, boundary_ids=[2]), hub, "author")
    reader = TrieSync(TokenTrie(6, boundary_ids=[2]), hub, "reader")
    author.share(served)
    author.sync_once()
    reader.sync_once()
    local, whole = learned_locally(served, cuts), learned_locally(served, [10**6])
    applied = columns(reader.trie)
    for name in ("token", "parent", "count", "source"):
        assert np.array_equal(applied[name], columns(local)[name]), name
    assert np.array_equal(applied["weight"], columns(whole)["weight"])  # weights as one piece (eviction only)
    assert reader.applied == len(served) and reader.trie.stats() == whole.stats()


class FlakyHub:
    """A real AnswerHub behind a link that can be cut (as a dead or unreachable actor is)."""

    def __init__(self) -> None:
        self.hub = AnswerHub()
        self.down = False

    def __getattr__(self, name: str):
        method = getattr(self.hub, name)

        def call(*args):
            if self.down:
                raise ConnectionError("the hub is unreachable")
            return method(*args)

        return call


def test_an_unreachable_hub_delays_sharing_and_loses_nothing_queued():
    link = FlakyHub()
    author = TrieSync(TokenTrie(4), link, "author", interval_s=3600)
    reader = TrieSync(TokenTrie(4), link, "reader")
    link.down = True
    author.start()  # joining fails quietly; serving would go on
    author.share([[5, 6, 7, 8]])
    author.sync_once()
    assert author.failures >= 2 and author.published == 0
    link.down = False
    author.sync_once()
    reader.sync_once()
    assert author.published == 1 and reader.applied == 1
    assert reader.trie.retrieve([5, 6], budget=4, max_depth=2, match_length=2).tokens == [7, 8]
    assert author.stop() is False  # the reader is still live: it saves last


def test_a_full_queue_gives_up_the_oldest_answers():
    link = FlakyHub()
    link.down = True
    author = TrieSync(TokenTrie(4), link, "author", max_pending=2)
    author.share([[1, 1], [2, 2], [3, 3]])
    link.down = False
    author.sync_once()
    assert author.given_up == 1
    assert link.hub.since("other", link.hub.epoch, 0).answers == [[2, 2], [3, 3]]


def test_a_restarted_hub_is_read_from_its_start():
    link = FlakyHub()
    author = TrieSync(TokenTrie(4), link, "author")
    reader = TrieSync(TokenTrie(4), link, "reader")
    author.share([[1, 2, 3]])
    author.sync_once()
    reader.sync_once()
    link.hub = AnswerHub()  # the actor died; Ray made an empty one
    author.share([[4, 5, 6]])
    author.sync_once()
    reader.sync_once()
    assert reader.applied == 2 and reader.epoch == link.hub.epoch


def test_another_tokenizer_turns_sharing_off_with_the_reason():
    hub = AnswerHub()
    first, second = TokenTrie(4), TokenTrie(4)
    first.tokenizer_id, second.tokenizer_id = "vocab-a", "vocab-b"
    TrieSync(first, hub, "a", interval_s=3600).start()
    other = TrieSync(second, hub, "b", interval_s=3600)
    other.start()
    other.share([[1, 2]])
    other.sync_once()
    assert other.refused and "another tokenizer" in other.refused
    assert hub.since("c", hub.epoch, 0).answers == []


def test_the_saver_reports_what_its_file_holds():
    hub = AnswerHub()
    saver = TrieSync(TokenTrie(4), hub, "saver", interval_s=3600)
    saver.start()
    other = TrieSync(TokenTrie(4), hub, "other", interval_s=3600)
    other.start()
    other.share([[1, 2, 3]])
    other.sync_once()
    assert saver.is_saver() and not other.is_saver()
    position = saver.before_save()
    saver.saved(position)
    assert hub.saved_through == 1 and saver.applied == 1
    assert not other.stop() and saver.stop()


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        TrieSync(TokenTrie(4), AnswerHub(), "a", interval_s=0)


def test_acceptance_counts_are_shared_once_each_even_across_a_hub_restart():
    from lookahead.drafting.policy import Calibration

    link = FlakyHub()
    mine, theirs = Calibration(2.0), Calibration(2.0)
    author = TrieSync(TokenTrie(4), link, "author", calibration=theirs)
    reader = TrieSync(TokenTrie(4), link, "reader", calibration=mine)
    theirs.record(np.array([0, 0, 5]), np.array([1.0, 0.0, 1.0]))
    author.sync_once()
    reader.sync_once()
    reader.sync_once()  # nothing new: nothing counted twice
    assert mine.sent[[0, 5]].tolist() == [2.0, 1.0] and mine.accepted[[0, 5]].tolist() == [1.0, 1.0]
    assert mine.observed[0].sum() == 0  # what others observed is not this replica's to share
    link.hub = AnswerHub()  # restarted empty: the reader hears the author's totals again, but they did not grow
    reader.sync_once()
    theirs.record(np.array([5]), np.array([0.0]))
    author.sync_once()
    reader.sync_once()
    assert mine.sent[[0, 5]].tolist() == [2.0, 2.0] and mine.accepted[[0, 5]].tolist() == [1.0, 1.0]
