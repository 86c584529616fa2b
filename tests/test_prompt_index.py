"""The prompt index against brute force, and the trie's drafts from it against the n-gram store it replaced."""

import heapq

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.drafting.ngrams import FOLLOWED, OUTPUT, OVERRULED, PROMPT
from lookahead.drafting.prompt_index import PromptIndex
from lookahead.drafting.trie import SCAN_CHILDREN, TokenTrie

BOUNDARY = 0
prompts = st.lists(st.integers(0, 5), max_size=60)  # a small alphabet, so strings repeat; 0 ends a turn
tails = st.lists(st.integers(0, 5), min_size=1, max_size=5)


def _occurrences(tokens, string):
    n = len(string)
    return [i for i in range(len(tokens) - n + 1) if tokens[i : i + n] == string]


def _following(tokens, string):
    """Brute force: token -> (times it follows `string`, the latest start of `string` it follows)."""
    seen = {}
    for start in _occurrences(tokens, string):
        if start + len(string) < len(tokens):
            token = tokens[start + len(string)]
            count, _ = seen.get(token, (0, start))
            seen[token] = (count + 1, start)
    return seen


def _children(index, handle, limit=10**9):
    offered = list(index.children(handle, limit))
    assert all(flags == PROMPT for _, _, flags, _ in offered)
    return [(token, count, child) for token, count, _, child in offered]


@settings(max_examples=300, deadline=None)
@given(prompts, tails, st.integers(2, 8))
def test_matches_counts_and_children_are_the_prompts_own(tokens, tail, depth_limit):
    index = PromptIndex(tokens, depth_limit, [BOUNDARY])
    handle = index.match(tail)
    continued = _following(tokens, tail)
    if BOUNDARY in tail or len(tail) >= depth_limit or not continued:
        assert handle is None
        return
    assert handle is not None and index.count(handle) == len(_occurrences(tokens, tail))
    below = [(list(tail), handle)]
    while below:  # every string the index offers below the tail, down to the depth limit
        string, handle = below.pop()
        offered = _children(index, handle)
        if string[-1] == BOUNDARY or len(string) >= depth_limit:
            assert offered == []  # a boundary ends an n-gram; nothing is sorted past the limit
            continue
        expected = _following(tokens, string)
        assert {token: count for token, count, _ in offered} == {t: c for t, (c, _) in expected.items()}
        latest = [expected[token][1] for token, _, _ in offered]
        assert latest == sorted(latest, reverse=True)  # most recently seen first, as the n-gram store lists them
        for token, count, child in offered:
            assert index.count(child) == count
            below.append(([*string, token], child))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=2, max_size=300), st.integers(1, 6))
def test_a_limited_scan_keeps_the_most_frequent_children(tokens, limit):
    index = PromptIndex(tokens, 4)
    handle = index.match(tokens[:1])
    offered = _children(index, handle, limit)
    everything = _children(index, handle)
    assert len(offered) == min(limit, len(everything))
    assert set(offered) <= set(everything)
    cut = sorted((count for _, count, _ in everything), reverse=True)[: len(offered)]
    assert sorted((count for _, count, _ in offered), reverse=True) == cut


def test_joined_prompts_share_counts_but_no_ngram_spans_the_gap():
    index = PromptIndex([1, 2, 3], 6).joined(PromptIndex([1, 2, 4], 6))
    handle = index.match([1, 2])
    assert index.count(handle) == 2
    assert sorted((token, count) for token, count, _ in _children(index, handle)) == [(3, 1), (4, 1)]
    assert index.match([3]) is None and index.match([2, 3, 1]) is None


def test_an_empty_prompt_matches_nothing():
    index = PromptIndex([], 36)
    assert len(index) == 0 and index.nbytes() == 0 and index.match([1]) is None


# ---- the trie's drafts against the n-gram store the index replaced ------------------------


class _Table:
    """Brute force of a per-request n-gram store: every n-gram up to `length` tokens, with its count,
    the time it was last seen (the store lists children latest first) and its source flags."""

    def __init__(self, length):
        self.length = length
        self.count, self.last, self.flags, self.clock = {}, {}, {}, 0

    def add(self, tokens, flag):
        for end in range(len(tokens)):
            for start in range(max(0, end - self.length + 1), end + 1):
                gram = tuple(tokens[start : end + 1])
                if BOUNDARY in gram[:-1]:
                    continue  # an n-gram never continues past a boundary
                self.count[gram] = self.count.get(gram, 0) + 1
                self.last[gram] = self.clock
                self.flags[gram] = self.flags.get(gram, 0) | flag
            self.clock += 1

    def children(self, gram):
        found = [key for key in self.count if len(key) == len(gram) + 1 and key[:-1] == gram]
        return sorted(found, key=self.last.__getitem__, reverse=True)[:SCAN_CHILDREN]


def _reference_retrieve(tables, context, budget, max_depth, match_length, branching):
    """The old retrieval, spelled out: longest continued tail, pooled counts, best-first by path ratio."""
    for length in range(min(match_length, len(context)), 0, -1):
        start = [(table, tuple(context[-length:])) for table in tables if table.children(tuple(context[-length:]))]
        if start:
            break
    else:
        return [], [], [], []
    tokens, parents, ratios, sources, heap, counter = [], [], [], [], [], 0

    def push(places, parent, path_chance, depth):
        nonlocal counter
        total = sum(table.count[gram] for table, gram in places)
        weight, pooled, flags = {}, {}, {}
        for table, gram in places:
            for child in table.children(gram):
                token = child[-1]
                weight[token] = weight.get(token, 0) + table.count[child]
                pooled.setdefault(token, []).append((table, child))
                flags[token] = flags.get(token, 0) | table.flags[child]
        for token in heapq.nlargest(budget - len(tokens) if branching else 1, weight, key=weight.__getitem__):
            counter += 1
            ratio = weight[token] / total
            entry = (-path_chance * ratio, counter, token, parent, depth, ratio, flags[token], pooled[token])
            heapq.heappush(heap, entry)

    push(start, 0, 1.0, 1)
    while heap and len(tokens) < budget:
        neg, _, token, parent, depth, ratio, flag, places = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        ratios.append(ratio)
        sources.append(flag)
        if depth < max_depth:
            push(places, len(tokens), -neg, depth + 1)
    return tokens, parents, ratios, sources


@settings(max_examples=300, deadline=None)
@given(
    prompts,
    st.lists(st.lists(st.integers(0, 5), max_size=25), max_size=3),
    tails,
    st.integers(1, 20),
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(2, 9),
    st.booleans(),
)
def test_drafts_equal_those_of_the_old_prompt_store(
    prompt, outputs, context, budget, depth, match_length, ngram_length, branching
):
    trie = TokenTrie(ngram_length=ngram_length, boundary_ids=[BOUNDARY], max_nodes=None)
    shared, private = _Table(ngram_length), _Table(ngram_length)
    for i, tokens in enumerate(outputs):
        trie.observe(i, tokens)
        shared.add(tokens, OUTPUT)
    trie.insert(prompt, request="r")
    private.add(prompt, PROMPT)
    tree = trie.retrieve(context, budget, depth, request="r", match_length=match_length, branching=branching)
    expected = _reference_retrieve([shared, private], context, budget, depth, match_length, branching)
    where_seen = [flags & ~(FOLLOWED | OVERRULED) for flags in tree.sources]  # the model's choices: test_trie.py
    assert (tree.tokens, tree.parents, tree.ratios, where_seen) == expected


def test_a_second_prompt_for_a_request_is_joined_to_the_first():
    trie = TokenTrie(ngram_length=4)
    trie.insert([1, 2, 3], request="r")
    trie.insert([1, 2, 4], request="r")
    tree = trie.retrieve([1, 2], 4, 4, request="r")
    assert sorted(tree.tokens) == [3, 4] and tree.ratios == [0.5, 0.5]
    assert len(trie.retrieve([3], 4, 4, request="r")) == 0  # no n-gram runs from one prompt into the next


def test_a_long_prompt_is_indexed_in_16_bytes_a_token_drafted_from_and_freed():
    rng = np.random.default_rng(0)
    phrases = rng.integers(1, 49_000, (400, 16))
    prompt = phrases[rng.integers(0, 400, 2048)].reshape(-1)  # 32k tokens of recurring 16-token phrases
    trie = TokenTrie(ngram_length=36, boundary_ids=[2])
    trie.observe("old", [1, 2, 3])
    before = trie.stats()
    trie.insert(prompt.tolist(), request="r")
    stats = trie.stats()
    assert stats["prompt_tokens"] == len(prompt) == 32_768
    assert stats["prompt_bytes"] / stats["prompt_tokens"] <= 16
    context = prompt[1000:1004].tolist()
    tree = trie.retrieve(context, 32, 32, request="r")
    assert tree.tokens and tree.sources[0] == PROMPT
    windows = np.lib.stride_tricks.sliding_window_view(prompt, 5)
    assert tree.tokens[0] in windows[(windows[:, :4] == context).all(axis=1), 4]  # it follows the context there
    trie.finish("r")
    assert trie.stats() == before
