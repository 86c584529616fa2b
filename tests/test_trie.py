import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.drafting.ngrams import CORPUS, FOLLOWED, OUTPUT, OVERRULED, PROMPT
from lookahead.drafting.trie import TokenTrie


def _paths(tree):
    """Token path from the root's child down to each node."""
    paths = []
    for token, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((*(paths[parent - 1] if parent else ()), token))
    return paths


def test_drafts_the_continuation_seen_before():
    trie = TokenTrie(ngram_length=6)
    trie.insert([1, 2, 3, 4, 5, 6, 7])
    tree = trie.retrieve([9, 9, 2, 3], budget=8, max_depth=3)
    assert tree.tokens == [4, 5, 6] and tree.parents == [0, 1, 2]


def test_best_first_prefers_the_frequent_branch_and_shares_prefixes():
    trie = TokenTrie(ngram_length=4)
    for _ in range(3):
        trie.insert([1, 2, 3, 4])
    trie.insert([1, 2, 5, 6])
    tree = trie.retrieve([1, 2], budget=2, max_depth=4)
    assert tree.tokens == [3, 4]
    tree = trie.retrieve([1, 2], budget=4, max_depth=4)
    assert sorted(_paths(tree)) == [(3,), (3, 4), (5,), (5, 6)]
    assert tree.scores[0] == 0.75


def test_prompt_ngrams_are_private_and_released():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 3, 4], request="a")
    assert trie.retrieve([2], 4, 4, request="a").tokens == [3, 4]
    assert len(trie.retrieve([2], 4, 4, request="b")) == 0
    assert len(trie.retrieve([2], 4, 4)) == 0
    trie.finish("a")
    assert len(trie.retrieve([2], 4, 4, request="a")) == 0
    assert trie.stats()["live_requests"] == 0


def test_outputs_are_shared_and_learned_incrementally():
    trie = TokenTrie(ngram_length=4)
    trie.observe("a", [7, 8])
    trie.observe("a", [9])
    trie.finish("a")
    assert trie.retrieve([7], 4, 4, request="b").tokens == [8, 9]


def test_draft_nodes_carry_where_they_were_seen():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 3], request="r")  # prompt
    trie.observe("r", [1, 2, 4])  # output
    trie.insert([1, 5])  # corpus
    tree = trie.retrieve([1], 8, 4, request="r")
    flags = dict(zip(_paths(tree), tree.sources, strict=True))
    assert flags == {  # and the output had 2 after 1 and 4 after 2
        (2,): PROMPT | OUTPUT | FOLLOWED,
        (2, 3): PROMPT | OVERRULED,
        (2, 4): OUTPUT | FOLLOWED,
        (5,): CORPUS | OVERRULED,
    }


def test_a_learned_chance_reorders_the_draft():
    trie = TokenTrie(ngram_length=4)
    for _ in range(3):
        trie.observe("other", [1, 2, 3])  # seen often in answers
    trie.insert([1, 7, 8], request="r")  # once in this prompt
    assert trie.retrieve([1], 1, 4, request="r").tokens == [2]

    def prefer_prompt(flags: int, ratio: float, deep: bool, matched: int, seen: int) -> float:
        return 0.9 if flags & PROMPT else 0.1

    prompt_first = trie.retrieve([1], 2, 4, request="r", chance=prefer_prompt)
    assert prompt_first.tokens == [7, 8] and prompt_first.scores == [0.25, 0.25]  # scores stay the trie's own


def test_each_node_says_how_often_its_ngram_was_seen_and_the_chance_hears_it():
    trie = TokenTrie(ngram_length=4)
    for _ in range(3):
        trie.observe("other", [1, 2, 3])
    trie.insert([1, 2, 9], request="r")
    trie.insert([1, 7, 8], request="r")
    heard = {}

    def chance(flags: int, ratio: float, deep: bool, matched: int, seen: int) -> float:
        heard[(flags, round(ratio, 2))] = seen
        return 0.5

    tree = trie.retrieve([1], 8, 3, request="r", chance=chance)
    seen = dict(zip(_paths(tree), tree.seen, strict=True))
    assert seen[(2,)] == 4 and seen[(7,)] == 1  # three answers and the prompt; the prompt once
    assert seen[(2, 3)] == 3 and seen[(2, 9)] == 1 and seen[(7, 8)] == 1
    assert heard[(PROMPT | OVERRULED, 0.2)] == 1 and heard[(PROMPT | OUTPUT | FOLLOWED, 0.8)] == 4
    assert tree.prefix(2).seen == tree.seen[:2] and tree.subtree([0]).seen == tree.seen[:1]


def test_the_models_own_last_choice_after_a_token_confirms_one_child_and_overrules_its_siblings():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 8], request="r")
    trie.insert([1, 3, 9], request="r")
    trie.insert([1, 2, 7])  # a corpus says what text holds, not what the model chooses

    def follow_flags() -> dict[tuple[int, ...], int]:
        tree = trie.retrieve([1], 8, 1, request="r")
        return {path: flags & (FOLLOWED | OVERRULED) for path, flags in zip(_paths(tree), tree.sources, strict=True)}

    assert follow_flags() == {(2,): 0, (3,): 0} and trie.stats()["model_choices"] == 0  # nothing known yet
    trie.observe("a", [1])
    trie.observe("a", [3])  # the pair spans two steps of one request
    assert follow_flags() == {(2,): OVERRULED, (3,): FOLLOWED}
    trie.learn_answer([5, 1, 2])  # another replica's answer: the model's output too, and the latest
    assert follow_flags() == {(2,): FOLLOWED, (3,): OVERRULED}
    trie.observe("b", [4])
    trie.observe("b", [1, 6])  # the latest choice after 1: every other child overruled
    assert follow_flags() == {(2,): OVERRULED, (3,): OVERRULED, (6,): FOLLOWED}
    assert trie.stats()["model_choices"] == 3  # after 1, 5 and 4


def test_learned_chances_of_siblings_never_add_up_past_one():
    trie = TokenTrie(ngram_length=3)
    for follower in range(10, 20):  # ten answers continued [1] ten ways, each once
        trie.observe("answers", [1, follower, follower + 50])
    generous = trie.retrieve([1], 30, 2, chance=lambda flags, ratio, deep, matched, seen: 0.5)
    first = [chance for chance, parent in zip(generous.chances, generous.parents, strict=True) if parent == 0]
    assert len(first) == 10 and sum(first) == pytest.approx(1.0), "only one of them can be accepted"
    deeper = [chance for chance, parent in zip(generous.chances, generous.parents, strict=True) if parent > 0]
    assert deeper and all(chance == pytest.approx(0.05) for chance in deeper), "an only child keeps its own 0.5"
    modest = trie.retrieve([1], 30, 2, chance=lambda flags, ratio, deep, matched, seen: 0.05)
    assert [c for c, p in zip(modest.chances, modest.parents, strict=True) if p == 0] == pytest.approx([0.05] * 10)


def test_retrieval_stops_at_the_first_node_under_its_floor():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 3, 4])
    trie.insert([1, 5, 6, 7])
    full = trie.retrieve([1], 8, 3)  # two branches of chance 1/2 each
    assert full.chances[:2] == [0.5, 0.5]
    assert trie.retrieve([1], 8, 3, floors=lambda: [0.0] * 8).tokens == full.tokens
    assert trie.retrieve([1], 8, 3, floors=lambda: [0.6] * 8).tokens == []  # 0.5 < 0.6 x 1
    stopped = trie.retrieve([1], 8, 3, floors=lambda: [0.4, 0.4, 0.4] + [0.0] * 5)
    assert stopped.tokens == full.tokens[:1]  # the second 0.5 < 0.4 x (1 + 0.5)
    priced = []
    assert trie.retrieve([9], 8, 3, floors=lambda: priced.append(1) or [0.0] * 8).tokens == []
    assert trie.retrieve([1], 8, 3, min_score=1.0, floors=lambda: priced.append(1) or [0.0] * 8).tokens == []
    assert not priced, "no node to take (nothing matched, or nothing likely enough): the floors are never priced"
    trie.retrieve([1], 8, 3, floors=lambda: priced.append(1) or [0.0] * 8)
    assert priced == [1]


def test_end_of_turn_is_a_boundary_not_an_end():
    trie = TokenTrie(ngram_length=4, boundary_ids=[0])
    trie.insert([5, 6, 0, 7, 8, 9], request="r")
    assert trie.retrieve([6], 4, 4, request="r").tokens == [0]
    assert trie.retrieve([7], 4, 4, request="r").tokens == [8, 9]
    assert len(trie.retrieve([0], 4, 4, request="r")) == 0


def test_longest_matching_tail_wins():
    trie = TokenTrie(ngram_length=5)
    trie.insert([1, 2, 3, 4])
    trie.insert([9, 3, 5])
    assert trie.retrieve([1, 2, 3], 1, 1, match_length=3).tokens == [4]
    assert trie.retrieve([9, 3], 1, 1, match_length=3).tokens == [5]


def test_a_tree_keeps_how_many_context_tokens_its_root_matched():
    trie = TokenTrie(ngram_length=5)
    trie.insert([1, 2, 3, 4])
    assert trie.retrieve([1, 2, 3], 4, 4, match_length=3).matched == 3
    assert trie.retrieve([7, 2, 3], 4, 4, match_length=3).matched == 2
    assert trie.retrieve([7, 3], 4, 4, match_length=3).prefix(1).matched == 1
    assert trie.retrieve([7, 4], 4, 4, match_length=3).matched == 0  # nothing follows: an empty tree


def test_single_path_mode():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 3])
    trie.insert([1, 4, 5])
    trie.insert([1, 4, 5])
    tree = trie.retrieve([1], budget=8, max_depth=4, branching=False)
    assert tree.is_chain and tree.tokens == [4, 5]


sequences = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=30), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(
    sequences,
    st.lists(st.integers(0, 6), min_size=1, max_size=6),
    st.integers(1, 20),
    st.integers(1, 6),
    st.booleans(),
)
def test_retrieved_drafts_are_paths_of_the_trie(seqs, context, budget, depth, branching):
    ngram_length = 8
    trie = TokenTrie(ngram_length=ngram_length)
    for seq in seqs:
        trie.insert(seq)
    tree = trie.retrieve(context, budget, depth, match_length=3, branching=branching)
    assert len(tree) <= budget
    assert all(d <= depth for d in tree.depths)
    assert all(p <= i for i, p in enumerate(tree.parents))
    assert len(set(zip(tree.parents, tree.tokens, strict=True))) == len(tree)  # shared prefixes stored once
    assert all(0 < s <= 1 for s in tree.scores)
    assert branching or tree.is_chain
    if tree.tokens:
        text = [tuple(seq) for seq in seqs]
        # some matched tail of the context, followed by each path, occurs in an inserted sequence
        for path in _paths(tree):
            assert any(_occurs((*context[-m:], *path), text) for m in range(1, 4) if m + len(path) <= ngram_length), (
                path
            )


def _occurs(needle, haystacks):
    n = len(needle)
    return any(hay[i : i + n] == needle for hay in haystacks for i in range(len(hay) - n + 1))
