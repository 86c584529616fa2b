"""Tree masks and positions as the model receives them."""

import numpy as np
import torch

from lookahead.backends.transformers.masks import causal_inputs, packed_inputs, tree_mask, tree_positions
from lookahead.drafting.tree import DraftTree


def test_mask_lets_each_node_see_past_and_its_ancestors_only():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    mask = tree_mask(tree, 3, torch.float32, "cpu")
    assert mask.shape == (1, 1, 4, 7)
    allowed = (mask[0, 0] == 0).numpy()
    assert allowed[:, :3].all()
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)
    assert (allowed[:, 3:] == expected).all()
    assert mask.min() == torch.finfo(torch.float32).min


def test_positions_follow_depth():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    assert tree_positions(tree, 7, "cpu").tolist() == [[7, 8, 8, 9]]


def test_masks_are_built_in_the_dtype_and_on_the_device_asked_for():
    tree = DraftTree(tokens=[10, 11, 12], parents=[0, 0, 1])
    mask = tree_mask(tree, 5, torch.bfloat16, "meta")
    assert mask.device.type == "meta" and mask.dtype == torch.bfloat16 and mask.shape == (1, 1, 4, 9)
    assert tree_positions(tree, 5, "meta").device.type == "meta"


def test_causal_inputs_for_a_chain():
    mask, positions = causal_inputs(4, 3, "cpu")
    assert mask.tolist() == [[1] * 7] and positions.tolist() == [[4, 5, 6]]


def test_packed_inputs_carry_only_real_tokens_and_mask_each_row_in_its_own_columns():
    tree = DraftTree([7, 8, 9], [0, 0, 1])  # root r; a, b under r; c under a
    ids, positions, packed = packed_inputs([[1, 7, 8, 9], [2]], [tree, None], [3, 5], torch.float32, "cpu")
    assert ids.tolist() == [[1, 7, 8, 9, 2]]
    assert positions.tolist() == [[3, 4, 4, 5, 5]], "each row's root at its own length, nodes by depth"
    assert packed.rows.tolist() == [0, 0, 0, 0, 1] and packed.columns.tolist() == [3, 4, 5, 6, 5]
    assert packed.roots.tolist() == [0, 4] and packed.end == 7
    roots = (packed.root_mask[:, 0, 0] == 0).int().tolist()
    assert roots == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]], "a root sees its row's entries and itself"
    (draft,) = packed.drafts  # row 1 drafts nothing: its root alone
    assert (draft.row, draft.start, draft.size) == (0, 1, 3)
    nodes = (draft.mask[0, 0] == 0).int().tolist()
    assert nodes == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0, 1]], "each node: its ancestors"
    assert packed.root_mask.min() == torch.finfo(torch.float32).min


def test_blocks_padded_into_one_call_see_what_their_own_calls_see():
    tree = DraftTree([7, 8, 9], [0, 0, 1])
    _, _, packed = packed_inputs([[1, 7, 8, 9], [2], [3, 6]], [tree, None, DraftTree([6], [0])], [3, 5, 2],
                                 torch.float32, "cpu")  # fmt: skip
    call = packed.one_call
    assert call is not None and call.width == 4, "5 padded places x 7 keys: cheaper than two more calls"
    assert call.gather.tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 5, 5], "short blocks padded with their root"
    assert call.scatter.tolist() == [0, 1, 2, 3, 4, 8, 9] and call.gather[call.scatter].tolist() == list(range(7))
    seen = call.mask[:, 0] == 0
    assert torch.equal(seen[:, 0], packed.root_mask[:, 0, 0] == 0), "a root sees what it sees in the roots' call"
    for draft in packed.drafts:
        keys = draft.mask.shape[-1]
        assert torch.equal(seen[draft.row, 1 : draft.size + 1, :keys], draft.mask[0, 0] == 0)
        assert not seen[draft.row, 1 : draft.size + 1, keys:].any(), "a node sees nothing past its row's block"
    assert torch.equal(seen[1, 1:], (packed.root_mask[1, 0, 0] == 0).expand(3, -1)), "padding sees as its root"


def test_one_call_is_left_where_its_padding_would_cost_more_than_the_calls_it_saves():
    deep = DraftTree(list(range(10, 26)), list(range(16)))  # one row drafts 16 nodes, seven draft none
    blocks = [[1, *deep.tokens]] + [[2 + row] for row in range(7)]
    _, _, packed = packed_inputs(blocks, [deep] + [None] * 7, [900] * 8, torch.float32, "cpu")
    assert packed.one_call is None and len(packed.drafts) == 1
    _, _, nodewise = packed_inputs([[1, 7], [2, 8]], [DraftTree([7], [0])] * 2, [5, 5], torch.float32, "cpu",
                                   nodewise=True)  # fmt: skip
    assert nodewise.one_call is None, "tokens attending one by one keep their own calls"
    _, _, asked = packed_inputs([[1, 7], [2, 8]], [DraftTree([7], [0])] * 2, [5, 5], torch.float32, "cpu",
                                one_call=False)  # fmt: skip
    assert asked.one_call is None and len(asked.drafts) == 2


def test_what_one_call_is_worth_follows_how_the_pass_attends_grouped_heads():
    chain = DraftTree([7, 8, 9], [0, 1, 2])
    blocks, trees = [[1, 7, 8, 9], [2, 7, 8, 9]] + [[3 + row] for row in range(6)], [chain] * 2 + [None] * 6
    # 18 padded queries x 304 columns for the 2 calls one call saves: 2,736 a call saved
    _, _, grouped = packed_inputs(blocks, trees, [300] * 8, torch.float32, "cpu")
    _, _, by_head = packed_inputs(blocks, trees, [300] * 8, torch.float32, "cpu", groups_as_heads=False)
    assert grouped.one_call is not None, "padded queries are cheap where a group of heads attends as one"
    assert by_head.one_call is None and len(by_head.drafts) == 2


def test_drafting_rows_far_shorter_than_the_longest_keep_their_own_calls():
    chain = DraftTree([7, 8, 9], [0, 1, 2])
    blocks, trees = [[1, 7, 8, 9], [2, 7, 8, 9], [3, 7, 8, 9]], [chain] * 3  # as wide as each other: no padding
    _, _, near = packed_inputs(blocks, trees, [600, 600, 600], torch.float32, "cpu")
    _, _, far = packed_inputs(blocks, trees, [20, 20, 3000], torch.float32, "cpu")
    assert near.one_call is not None
    assert far.one_call is None, "two rows' nodes would read 2,980 columns past their own rows"


def test_packed_window_masks_hide_keys_a_window_or_more_before_each_query():
    tree = DraftTree([7, 8, 9], [0, 0, 1])  # as above; window 3: a query at position p sees positions > p - 3
    blocks, trees, lengths = [[1, 7, 8, 9], [2]], [tree, None], [3, 5]
    _, _, packed = packed_inputs(blocks, trees, lengths, torch.float32, "cpu", window=3, sliding_layers=frozenset({1}))
    assert packed.sliding_layers == {1}
    roots = (packed.window_root_mask[:, 0, 0] == 0).int().tolist()
    assert roots == [[0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0]], "roots at positions 3 and 5"
    (draft,) = packed.drafts
    nodes = (draft.window_mask[0, 0] == 0).int().tolist()
    assert nodes == [[0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 1, 0], [0, 0, 0, 1, 1, 0, 1]], "nodes at 4, 4 and 5"
    unwindowed = packed_inputs(blocks, trees, lengths, torch.float32, "cpu")[2]
    assert torch.equal(unwindowed.root_mask, packed.root_mask) and torch.equal(unwindowed.drafts[0].mask, draft.mask)
    assert unwindowed.window_root_mask is None and unwindowed.drafts[0].window_mask is None
    assert unwindowed.sliding_layers == frozenset()
