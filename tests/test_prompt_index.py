"""The prompt index against brute force."""

from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.drafting.ngrams import PROMPT
from lookahead.drafting.prompt_index import PromptIndex

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
    index = PromptIndex([1, 2, 3], 6).joined([1, 2, 4])
    handle = index.match([1, 2])
    assert index.count(handle) == 2
    assert sorted((token, count) for token, count, _ in _children(index, handle)) == [(3, 1), (4, 1)]
    assert index.match([3]) is None and index.match([2, 3, 1]) is None


def test_an_empty_prompt_matches_nothing():
    index = PromptIndex([], 36)
    assert len(index) == 0 and index.nbytes() == 0 and index.match([1]) is None
