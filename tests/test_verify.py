from lookahead.decoding.verify import accept_greedy
from lookahead.drafting.tree import DraftTree

# root; 1:a=10 under root, 2:b=11 under root, 3:c=12 under a, 4:d=13 under c
TREE = DraftTree(tokens=[10, 11, 12, 13], parents=[0, 0, 1, 3])


def test_empty_draft_emits_the_bonus_token():
    assert accept_greedy(DraftTree(), [42]) == ([], [42])


def test_walks_the_agreeing_branch_and_adds_the_bonus():
    # by block index: the model picks 10 at the root, 12 at a, 13 at c, 99 at d
    choices = [10, 12, 0, 13, 99]
    assert accept_greedy(TREE, choices) == ([1, 3, 4], [10, 12, 13, 99])


def test_takes_the_other_branch():
    assert accept_greedy(TREE, [11, 0, 7, 0, 0]) == ([2], [11, 7])


def test_stops_at_first_disagreement():
    assert accept_greedy(TREE, [10, 55, 0, 0, 0]) == ([1], [10, 55])
    assert accept_greedy(TREE, [77, 12, 0, 13, 0]) == ([], [77])
