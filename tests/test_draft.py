import numpy as np
import pytest
import torch

from lookahead.draft import DraftTree


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


def test_mask_lets_each_node_see_past_and_its_ancestors_only():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    mask = tree.attention_mask(past_length=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 7)
    allowed = (mask[0, 0] == 0).numpy()
    assert allowed[:, :3].all()
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert (allowed[:, 3:] == expected).all()
    assert mask.min() == torch.finfo(torch.float32).min


def test_positions_follow_depth():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    assert tree.position_ids(7).tolist() == [[7, 8, 8, 9]]


def test_subtree_reindexes_and_keeps_every_column():
    tree = DraftTree(tokens=[10, 11, 12, 13], parents=[0, 0, 1, 3], scores=[0.9, 0.5, 0.4, 0.3], sources=[4, 1, 4, 5])
    small = tree.subtree([0, 2, 3])
    assert small.tokens == [10, 12, 13] and small.parents == [0, 1, 2]
    assert small.scores == [0.9, 0.4, 0.3] and small.sources == [4, 4, 5]
    assert tree.subtree([]).tokens == []


def test_subtree_refuses_an_orphan():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 1, 2])
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 2])
