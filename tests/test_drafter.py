"""The trie drafter: one request's drafts, cut by the engine's policy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_policy import FLAT, STEEP, rising

from lookahead.config import LookaheadConfig
from lookahead.drafting.drafter import TrieDrafting
from lookahead.drafting.policy import CostModel, DraftPolicy
from lookahead.drafting.tree import DraftTree
from lookahead.drafting.trie import TokenTrie


def test_drafters_cut_the_tree_by_policy():
    trie = TokenTrie(ngram_length=8)
    for _ in range(3):
        trie.insert([1, 2, 3, 4, 5, 6])
    trie.insert([1, 9, 8, 7])
    config = LookaheadConfig(decoding_length=8, branch_length=6)

    def sent(policy: DraftPolicy) -> DraftTree:
        drafting = TrieDrafting(config, trie, policy)
        return drafting.fit([drafting.open([]).propose([1], 100, branching=True)], context=1)[0]

    assert len(sent(DraftPolicy())) == 8
    assert len(sent(DraftPolicy(STEEP))) == 0
    tree = sent(DraftPolicy(FLAT))
    assert len(tree) == 8 and isinstance(tree, DraftTree)


def test_drafting_is_built_from_the_config():
    cost = CostModel({1: 50.0, 64: 60.0})
    adaptive = TrieDrafting.from_config(LookaheadConfig(branch_length=6, match_length=2), [0], cost)
    assert adaptive.trie.ngram_length == 8 and adaptive.trie.boundary_ids == {0}
    assert adaptive.policy.cost is cost
    fixed = TrieDrafting.from_config(LookaheadConfig(policy="fixed"), [0], cost)
    assert not fixed.policy.adaptive, "a fixed policy sends the whole tree whatever the cost"
    shared = TokenTrie(ngram_length=5)
    assert TrieDrafting.from_config(LookaheadConfig(), [], cost, shared).trie is shared


def test_a_drafter_holds_its_prompt_until_closed_and_respects_the_room_left():
    trie = TokenTrie(ngram_length=8)
    drafting = TrieDrafting(LookaheadConfig(policy="fixed"), trie, DraftPolicy())
    drafter = drafting.open([1, 2, 3, 4, 5, 6, 7])
    assert trie.stats()["live_requests"] == 1
    assert drafter.propose([9, 1], 100, branching=True).tokens == [2, 3, 4, 5, 6, 7]
    assert drafter.propose([9, 1], 3, branching=True).tokens == [2, 3], "the bonus token takes the last place"
    drafter.learn([8, 8, 8])
    drafter.close()
    assert trie.stats()["live_requests"] == 0 and trie.stats()["tokens_learned"] == 3


token_runs = st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=24), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    token_runs,
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.lists(st.floats(1.0, 300.0), min_size=2, max_size=12),
    st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3, unique=True), min_size=10, max_size=10),
    st.integers(1, 16),
)
def test_a_row_alone_sends_what_it_sends_with_the_whole_tree(runs, context, curve, following, leaves):
    """The floors leave out only what the policy would not send: same nodes with and without, on any curve,
    with retrieval and the model's recycled guesses in one tree, cut to the leaves a verifier allows."""
    trie = TokenTrie(ngram_length=6, recycled=3)
    for run in runs:
        trie.insert(run)
    trie.recycle(list(range(10)), np.array(following, dtype=np.int32))
    config = LookaheadConfig(decoding_length=16, branch_length=8, match_length=3)
    drafting = TrieDrafting(config, trie, DraftPolicy(CostModel(dict(enumerate(curve, start=1)))))
    drafter = drafting.open(runs[0][:4])
    proposed = [
        drafter.propose(context, 100, branching=True, alone=alone).within_leaves(leaves) for alone in (True, False)
    ]
    floored, whole = (drafting.fit([tree], len(context) - 1)[0] for tree in proposed)
    assert len(proposed[0]) <= len(proposed[1])
    assert (floored.tokens, floored.parents) == (whole.tokens, whole.parents)


@settings(max_examples=150, deadline=None)
@given(
    token_runs,
    st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=2, max_size=4),
    st.one_of(rising, st.lists(st.floats(20.0, 300.0), min_size=2, max_size=12)),
    st.lists(st.floats(0.01, 1.0), min_size=4, max_size=4) | st.none(),
    st.integers(1, 16),
)
def test_rows_of_a_packed_step_send_what_they_send_with_the_whole_trees(runs, contexts, curve, last, leaves):
    """Each row's retrieval stops under its least chance (Drafting.least): the step sends the same nodes, whatever
    the batch's price curve and the rows' worths in a closed batch."""
    trie = TokenTrie(ngram_length=6)
    for run in runs:
        trie.insert(run)
    rows = len(contexts)
    cost = CostModel({1: 20.0, 64: 40.0}, batched={rows: dict(enumerate(curve, start=1))})
    policy = DraftPolicy(cost)
    policy.packed = True
    drafting = TrieDrafting(LookaheadConfig(decoding_length=16, branch_length=8, match_length=3), trie, policy)
    drafters = [drafting.open(runs[0][:4]) for _ in contexts]
    last = None if last is None else [value / sum(last[:rows]) for value in last[:rows]]
    context = max(map(len, contexts)) - 1
    least = drafting.least(rows, context, last)
    assert least is not None and len(least) == rows

    def sent(floors: list[float]) -> list[DraftTree]:
        trees = [
            drafter.propose(tokens, 100, branching=True, least=floor).within_leaves(leaves)
            for drafter, tokens, floor in zip(drafters, contexts, floors, strict=True)
        ]
        return drafting.fit(trees, context, last)

    floored, whole = sent(least), sent([0.0] * rows)
    assert [(tree.tokens, tree.parents) for tree in floored] == [(tree.tokens, tree.parents) for tree in whole]


def test_a_drafter_sends_its_chances_discounted_and_the_policy_learns_from_them_as_drafted():
    trie = TokenTrie(ngram_length=8)
    trie.insert([1, 2, 3, 4, 5, 6])
    policy = DraftPolicy(FLAT)
    drafter = TrieDrafting(LookaheadConfig(decoding_length=8, branch_length=6), trie, policy).open([])
    assert len(drafter.propose([1], 100, branching=True)) == 5
    assert policy.path_discount(drafter.rates).tolist() == [1.0] * len(policy.paths)
    for _ in range(50):
        drafter.verified(drafter.propose([1], 100, branching=True), [1])  # only the first node ever holds
    tree = drafter.propose([1], 100, branching=True)
    discount = policy.discounted(tree, drafter.rates)
    assert discount[0] == 1.0 > discount[-1], "the chances sent are discounted where paths ran hopeful"
    drafted = np.asarray(tree.chances) / discount
    given = policy.paths[1].expected
    drafter.verified(tree, [1])
    assert policy.paths[1].expected == pytest.approx(given * 0.998 + drafted[1]), "counted as drafted"
