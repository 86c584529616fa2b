"""DraftTree: plain data — depths, children, subtrees, the ancestor relation."""

import numpy as np
import pytest

from lookahead.drafting.tree import DraftTree


def test_depths_chain_and_children():
    tree = DraftTree(tokens=[10, 11, 12, 13], parents=[0, 0, 1, 3])
    assert tree.depths == [1, 1, 2, 3]
    assert not tree.is_chain
    assert DraftTree([5, 6, 7], [0, 1, 2]).is_chain
    assert tree.children() == [{10: 1, 11: 2}, {12: 3}, {}, {13: 4}, {}]


def test_parents_must_come_first():
    with pytest.raises(ValueError):
        DraftTree(tokens=[1, 2], parents=[0, 2])
    with pytest.raises(ValueError):
        DraftTree(tokens=[1], parents=[0, 0])


def test_subtree_reindexes_and_keeps_every_column():
    tree = DraftTree(
        [10, 11, 12, 13], parents=[0, 0, 1, 3], ratios=[0.9, 0.5, 0.5, 0.75], sources=[4, 1, 4, 5], matched=3
    )
    small = tree.subtree([0, 2, 3])
    assert small.tokens == [10, 12, 13] and small.parents == [0, 1, 2] and small.matched == tree.prefix(2).matched == 3
    assert small.ratios == [0.9, 0.5, 0.75] and small.sources == [4, 4, 5]
    assert small.scores == tree.scores[:1] + tree.scores[2:] == [0.9, 0.45, 0.3375]
    assert tree.subtree([]).tokens == []


def test_subtree_refuses_an_orphan():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 1, 2])
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 2])


def test_ancestor_matrix_marks_each_entry_and_its_ancestors():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert (tree.ancestor_matrix() == expected).all()


def test_within_leaves_keeps_the_longest_prefix_with_that_many_leaves():
    # r -> a -> c -> d, r -> b, a -> e: leaves grow 1 (a), 2 (b), 2 (c extends a), 2 (d), 3 (e)
    tree = DraftTree(tokens=[10, 11, 12, 13, 14], parents=[0, 0, 1, 3, 1])
    assert tree.within_leaves(1).tokens == [10]
    assert tree.within_leaves(2).tokens == [10, 11, 12, 13]
    assert tree.within_leaves(3) is tree
    assert DraftTree([5, 6, 7], [0, 1, 2]).within_leaves(1).tokens == [5, 6, 7]
