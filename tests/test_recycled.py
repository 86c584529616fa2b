"""Recycled drafts: the table of each token's likeliest next tokens, and the draft trees it joins."""

import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save

from lookahead import LookaheadConfig
from lookahead.drafting.drafter import TrieDrafter
from lookahead.drafting.ngrams import OUTPUT, PROMPT, RECYCLED
from lookahead.drafting.policy import TRIE_PRIOR, Calibration, DraftPolicy
from lookahead.drafting.recycled import RecycledTable, rank_of, rank_ratio
from lookahead.drafting.tree import DraftTree
from lookahead.drafting.trie import TokenTrie
from lookahead.drafting.triefile import _PREFIX, MAGIC, read_trie


def _paths(tree):
    paths = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((*(paths[parent - 1] if parent else ()), token))
    return paths


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(0, 300), min_size=3, max_size=3)), max_size=60))
def test_table_equals_a_brute_force_reference(updates):
    """Updates in pieces, as steps make them: each token's row is the last one written for it."""
    table, reference = RecycledTable(3), {}
    for start in range(0, len(updates), 4):
        piece = updates[start : start + 4]
        table.update([key for key, _ in piece], np.array([row for _, row in piece], dtype=np.int32).reshape(-1, 3))
        reference.update({key: row for key, row in piece})
    for token in range(302):
        assert table.followers(token) == reference.get(token, [])
    assert len(table) == len(reference)
    assert table.largest_token() == max([-1, *reference, *(t for row in reference.values() for t in row)])


def test_table_rows_narrower_or_wider_than_k():
    table = RecycledTable(3)
    table.update([5], np.array([[7, 8]]))  # a verifier giving fewer: the rest unknown
    table.update([6], np.array([[1, 2, 3, 4]]))  # more: the first k kept
    assert table.followers(5) == [7, 8] and table.followers(6) == [1, 2, 3]
    assert table.followers(10**6) == [] and table.followers(0) == []


def test_a_saved_table_is_checked():
    with pytest.raises(ValueError, match="twice"):
        RecycledTable.from_rows(np.array([[5, 5], [1, -1]], dtype=np.int32))
    assert RecycledTable.from_rows(np.array([[5, -1, -1]], dtype=np.int32)).followers(0) == [5]
    with pytest.raises(ValueError, match="2 tokens but 1 rows"):
        RecycledTable(2).update([1, 2], np.array([[3, 4]]))
    with pytest.raises(ValueError, match="out of range"):
        RecycledTable.from_rows(np.array([[-2, 0]], dtype=np.int32))
    with pytest.raises(ValueError, match="array of shape"):
        RecycledTable.from_rows(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="at least one"):
        RecycledTable(0)


def test_rank_codes_round_trip_and_fall_in_their_own_cells():
    assert [rank_of(rank_ratio(rank)) for rank in range(64)] == list(range(64))
    cells = [Calibration.cell(RECYCLED, rank_ratio(rank), False, 0) for rank in range(6)]
    assert len(set(cells[:5])) == 5 and cells[4] == cells[5], "ranks 0-3 apart, 4 and later together"
    trie_cells = {Calibration.cell(flags, ratio / 10, deep, matched) for flags in (PROMPT, OUTPUT, 0)
                  for ratio in range(11) for deep in (False, True) for matched in range(6)}  # fmt: skip
    assert not trie_cells & set(cells), "a cell apart from every trie source's"
    assert Calibration.cell(RECYCLED | PROMPT, 0.9, False, 2) == Calibration.cell(PROMPT, 0.9, False, 2)
    assert TRIE_PRIOR[cells[0]] > TRIE_PRIOR[cells[1]] > TRIE_PRIOR[cells[4]]


def test_recycled_children_join_the_trie_tree_once_with_their_tags():
    trie = TokenTrie(ngram_length=6, recycled=3)
    trie.insert([1, 2, 3, 4], request="r")
    trie.recycle([2, 3, 9], np.array([[3, 7, 8], [9, 4, 5], [6, 0, 1]]))
    chance = lambda flags, ratio, deep, matched, seen: 0.3 * ratio if flags == RECYCLED else 0.6  # noqa: E731 (learned rates)
    tree = trie.retrieve([1, 2], budget=32, max_depth=3, request="r", chance=chance)
    paths = _paths(tree)
    assert len(paths) == len(set(paths)), "no node offered twice"
    flags = dict(zip(paths, tree.sources, strict=True))
    assert flags[(3,)] == PROMPT | RECYCLED, "found by both: both tags"
    assert flags[(7,)] == RECYCLED and flags[(8,)] == RECYCLED
    assert flags[(3, 4)] == PROMPT | RECYCLED and flags[(3, 9)] == RECYCLED and flags[(3, 9, 6)] == RECYCLED
    assert tree.chances == sorted(tree.chances, reverse=True), "likeliest first: every prefix a tree"
    chances = dict(zip(paths, tree.chances, strict=True))
    assert chances[(3,)] == pytest.approx(0.6) and chances[(7,)] == pytest.approx(0.15)
    for parent in range(len(tree) + 1):  # siblings' chances never add up past their parent's
        siblings = [c for c, p in zip(tree.chances, tree.parents, strict=True) if p == parent]
        assert sum(siblings) <= ([1.0, *tree.chances][parent]) + 1e-9


def test_a_token_offered_twice_is_one_node():
    """By retrieval and the table, or twice by a row (a table is data: a file could hold one)."""
    trie = TokenTrie(ngram_length=4, recycled=3)
    trie.insert([1, 2, 3], request="r")
    trie._recycled._rows = np.array([[-1, -1, -1], [-1, -1, -1], [3, 7, 7], [7, 7, 3]], dtype=np.int32)
    tree = trie.retrieve([1, 2], budget=8, max_depth=2, request="r", chance=lambda *cell: 0.3)
    paths = _paths(tree)
    assert len(paths) == len(set(paths)) and {(3,), (7,), (3, 7)} <= set(paths)


def test_guesses_share_only_what_retrieval_leaves():
    """A continuation retrieval is sure of keeps its chance: a copied run is not diluted at every depth."""
    trie = TokenTrie(ngram_length=6, recycled=2)
    trie.insert([1, 2, 3, 4, 5], request="r")
    trie.recycle([2, 3, 4], np.array([[8, 9], [8, 9], [8, 9]]))
    sure = trie.retrieve([1, 2], budget=32, max_depth=3, request="r")  # counts say 1.0: no room for guesses
    assert sure.tokens == [3, 4, 5] and sure.chances == [1.0, 1.0, 1.0]
    chance = lambda flags, ratio, deep, matched, seen: 0.4 if flags == RECYCLED else 0.8  # noqa: E731
    tree = trie.retrieve([1, 2], budget=32, max_depth=1, request="r", chance=chance)
    assert dict(zip(tree.tokens, tree.chances, strict=True)) == pytest.approx({3: 0.8, 8: 0.1, 9: 0.1})


def test_the_table_drafts_where_retrieval_has_nothing_and_chains_stay_chains():
    trie = TokenTrie(ngram_length=4, recycled=2)
    assert len(trie.retrieve([5], 8, 4)) == 0
    trie.recycle([5, 6], np.array([[6, 1], [7, 2]]))
    # ranks 0 and 1 share the root's chance 2:1; 6 → 7 (0.44) is likelier than 1 (0.33)
    assert _paths(trie.retrieve([4, 5], 8, 4)) == [(6,), (6, 7), (1,), (6, 2)]
    chain = trie.retrieve([4, 5], 8, 4, branching=False)
    assert chain.is_chain and chain.tokens == [6, 7]
    off = TokenTrie(ngram_length=4)
    off.recycle([5], np.array([[6, 1]]))  # a trie without a table keeps nothing
    assert off.recycled is None and len(off.retrieve([5], 8, 4)) == 0


def test_the_drafter_learns_the_kept_path_up_to_a_stop():
    trie = TokenTrie.from_config(LookaheadConfig(recycled=2), [0])
    drafter = TrieDrafter(trie, LookaheadConfig(recycled=2), DraftPolicy(), [1, 2, 3])
    tree = drafter.propose([1, 2, 3], room=10, branching=True)
    # suppose the model accepted nothing: the root's position only
    drafter.verified(tree.prefix(0), [], np.array([[4, 5]]))
    drafter.learn([4])
    assert trie.recycled.followers(3) == [4, 5]
    # accepted two nodes, but a stop ended the request after the first emitted token
    drafter.propose([1, 2, 3, 4], room=10, branching=True)
    trie_tree = DraftTree(tokens=[8, 9], parents=[0, 1])
    drafter.verified(trie_tree, [1, 2], np.array([[8, 1], [9, 1], [7, 1]]))
    drafter.learn([8])
    assert trie.recycled.followers(4) == [8, 1] and trie.recycled.followers(8) == []


def test_the_drafter_learns_what_the_model_expected_after_nodes_turned_down():
    trie = TokenTrie.from_config(LookaheadConfig(recycled=2), [0])
    drafter = TrieDrafter(trie, LookaheadConfig(recycled=2), DraftPolicy(), [1, 2, 3])
    table = trie.recycled
    table.update([7], np.array([[3, 4]]))
    drafter.propose([1, 2, 3], room=10, branching=True)
    # root 3 → {5 → 6, 7, 9}: 5 accepted; 6, 7 and 9 turned down; the verifier does not know what follows 7
    tree = DraftTree(tokens=[5, 6, 7, 9], parents=[0, 1, 0, 0])
    rows = np.array([[5, 7], [2, 6], [8, 1], [-1, -1], [4, 2]])
    drafter.verified(tree, [1], rows)
    assert table.followers(6) == [], "learned when the request learns its tokens, not before"
    drafter.learn([5, 2])
    assert [table.followers(t) for t in (3, 5, 6, 7, 9)] == [[5, 7], [2, 6], [8, 1], [3, 4], [4, 2]]
    # root 2 → 4 → 4, the first 4 kept: the kept position's row has the last word
    drafter.propose([1, 2, 3, 5, 2], room=10, branching=True)
    drafter.verified(DraftTree(tokens=[4, 4], parents=[0, 1]), [1], np.array([[4, 1], [6, 5], [9, 8]]))
    drafter.learn([4, 6])
    assert table.followers(2) == [4, 1] and table.followers(4) == [6, 5]
    # a stop after the root's token: what followed the nodes turned down is learned, the kept path only to the stop
    drafter.propose([1, 2, 3, 5, 2, 4, 6], room=10, branching=True)
    drafter.verified(DraftTree(tokens=[11, 12], parents=[0, 0]), [2], np.array([[12, 1], [13, 1], [14, 1]]))
    drafter.learn([12])
    assert table.followers(6) == [12, 1] and table.followers(11) == [13, 1] and table.followers(12) == []


def test_a_trie_file_keeps_the_table_and_old_files_load(tmp_path):
    trie = TokenTrie(ngram_length=4, recycled=2)
    trie.observe("a", [1, 2, 3])
    trie.recycle([2], np.array([[3, 4]]))
    trie.save(tmp_path / "t.trie")
    loaded = TokenTrie.load(tmp_path / "t.trie")
    assert loaded.recycled.followers(2) == [3, 4] and loaded.retrieve([1], 4, 4).tokens[:2] == [2, 3]
    plain = TokenTrie(ngram_length=4)
    plain.insert([1, 2, 3])  # a corpus: nothing the model chose either
    plain.save(tmp_path / "p.trie")
    assert TokenTrie.load(tmp_path / "p.trie").recycled is None
    assert _PREFIX.unpack((tmp_path / "p.trie").read_bytes()[: _PREFIX.size])[1] == 1, "no table: readable by v1"
    assert _PREFIX.unpack((tmp_path / "t.trie").read_bytes()[: _PREFIX.size])[1] == 3, "what the model chose: v3"
    # a file of version 1, written before the table existed: no `recycled` setting, no column
    columns, settings = read_trie(tmp_path / "p.trie")
    old = {name: value for name, value in asdict(settings).items() if name != "recycled"}
    payload = save(columns, metadata={"lookahead-trie": json.dumps(old)})
    prefix = _PREFIX.pack(MAGIC, 1, len(payload), hashlib.sha256(payload).digest())
    (tmp_path / "v1.trie").write_bytes(prefix + payload)
    v1 = TokenTrie.load(tmp_path / "v1.trie")
    assert v1.recycled is None and v1.retrieve([1], 4, 4).tokens == [2, 3]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        loaded.check_vocabulary(4)
