"""The trie as a long-lived index: budget, eviction, prompt release, save / load, refused files."""

import os
import pickle
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.drafting.ngrams import OUTPUT, NgramStore
from lookahead.drafting.trie import TokenTrie
from lookahead.drafting.triefile import MAGIC, STALE_SCRATCH_S, remove_stale_scratch, tokenizer_fingerprint


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def _ngrams(store) -> dict[tuple[int, ...], int]:
    """Every stored n-gram with its count, read from the store's columns."""
    return {tuple(store.path(int(n))): store.count[int(n)] for n in store.live()}


def _check_structure(store) -> None:
    """Index, parent links and sibling lists agree, counts are positive and never exceed the parent's."""
    live = {int(n) for n in store.live()}
    assert len(live) == len(store.index)
    for node in live:
        parent = store.parent[node]
        assert parent == 0 or parent in live
        assert store.index[parent << 24 | store.token[node]] == node
        assert store.count[node] >= 1
        if parent:
            assert store.count[node] <= store.count[parent]
    for node in [0, *live]:
        kids = [child for _, child in store.children(node)]
        assert len(kids) == len(set(kids)) and all(store.parent[k] == node for k in kids)
        assert sorted(kids) == sorted(n for n in live if store.parent[n] == node)


token_lists = st.lists(st.integers(0, 9), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=8), st.integers(5, 80), st.sampled_from([None, 3.0, 1000.0]))
def test_budget_is_respected_after_every_call_and_structure_stays_sound(outputs, max_nodes, half_life):
    trie = TokenTrie(ngram_length=5, max_nodes=max_nodes, half_life=half_life)
    for i, tokens in enumerate(outputs):
        for start in range(0, len(tokens), 7):  # a request learns a few tokens at a time
            trie.observe(i, tokens[start : start + 7])
            assert len(trie) <= max_nodes
        trie.finish(i)
    _check_structure(trie._shared)


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=6))
def test_without_eviction_counts_are_the_ngram_occurrences(outputs):
    trie = TokenTrie(ngram_length=4, max_nodes=None)
    expected: dict[tuple[int, ...], int] = {}
    for i, tokens in enumerate(outputs):
        trie.observe(i, tokens)
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + 4, len(tokens)) + 1):
                expected[tuple(tokens[start:end])] = expected.get(tuple(tokens[start:end]), 0) + 1
    assert _ngrams(trie._shared) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=4), token_lists, token_lists)
def test_released_prompts_leave_nothing_behind(outputs, prompt, generated):
    trie = TokenTrie(ngram_length=5, max_nodes=None)
    for i, tokens in enumerate(outputs):
        trie.observe(i, tokens)
    before = _ngrams(trie._shared)
    trie.insert(prompt, request="r")
    assert trie.stats()["prompt_tokens"] == len(prompt)
    trie.observe("r", generated)
    trie.finish("r")
    reference = TokenTrie(ngram_length=5, max_nodes=None)
    for i, tokens in enumerate([*outputs, generated]):
        reference.observe(i, tokens)
    assert _ngrams(trie._shared) == _ngrams(reference._shared)  # only what was generated stayed
    assert set(before) <= set(_ngrams(trie._shared))
    assert trie.stats()["prompt_tokens"] == 0 and trie.stats()["live_requests"] == 0


def test_a_long_prompt_leaves_nothing_behind():
    rng = np.random.default_rng(0)
    trie = TokenTrie(ngram_length=12)
    trie.observe("old", [1, 2, 3])
    before = trie.stats()
    trie.insert(rng.integers(0, 49_000, 4000).tolist(), request="r")
    assert trie.stats()["prompt_tokens"] == 4000 and trie.stats()["prompt_bytes"] > 0
    trie.finish("r")
    assert trie.stats() == before


def test_eviction_keeps_frequent_ngrams_and_lets_new_ones_in():
    trie = TokenTrie(ngram_length=3, max_nodes=60, half_life=200.0)
    for _ in range(20):
        trie.observe("often", [1, 2, 3])
        trie.finish("often")
    rng = np.random.default_rng(1)
    for i in range(30):  # one-off n-grams fill and overflow the budget
        trie.observe(i, rng.integers(10, 1000, 6).tolist())
        trie.finish(i)
    trie.observe("new", [7, 8, 9])
    assert trie.retrieve([1], 4, 4).tokens == [2, 3]
    assert trie.retrieve([7], 4, 4).tokens == [8, 9]
    assert trie.stats()["evicted_nodes"] > 0


def test_plain_counts_keep_old_ngrams_and_fast_decay_forgets_them():
    def survivors(half_life):
        trie = TokenTrie(ngram_length=2, max_nodes=40, half_life=half_life)
        for _ in range(10):
            trie.observe("old", [1, 2])
            trie.finish("old")
        for i in range(200):
            trie.observe(i, [100 + i % 30, 200 + i % 30])
            trie.finish(i)
        return trie.retrieve([1], 1, 1).tokens

    assert survivors(None) == [2]
    assert survivors(1.0) == []


def test_a_feed_survives_eviction_of_its_open_ngrams():
    trie = TokenTrie(ngram_length=6, max_nodes=10, half_life=1.0)
    for start in range(0, 60, 3):
        trie.observe("long", list(range(start, start + 3)))
        assert len(trie) <= 10
    _check_structure(trie._shared)


def _depths_by_walking_up(store) -> list[int]:
    depths = [0] * len(store.token)
    for node in store.live().tolist():
        up = node
        while up:
            depths[node] += 1
            up = store.parent[up]
    return depths


@settings(max_examples=100, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=8), st.integers(3, 40))
def test_depths_are_the_path_lengths_whatever_the_row_order(outputs, max_nodes):
    trie = TokenTrie(ngram_length=5, max_nodes=max_nodes, half_life=3.0)
    for i, tokens in enumerate(outputs):  # evictions free rows, and new nodes reuse them
        trie.observe(i, tokens)
        trie.finish(i)
    assert trie._shared.depths().tolist() == _depths_by_walking_up(trie._shared)


def test_depths_of_a_reused_row_below_a_later_row():
    store = NgramStore()
    (a,) = store.advance([0], 1, 1.0, OUTPUT)
    (b,) = store.advance([0], 2, 5.0, OUTPUT)
    (c,) = store.advance([b], 3, 5.0, OUTPUT)
    assert store.evict(2).tolist() == [a]
    (d,) = store.advance([c], 4, 5.0, OUTPUT)
    assert d == a < c  # the freed first row now sits below the third
    assert store.depths().tolist() == [0, 3, 1, 2] == _depths_by_walking_up(store)


def test_depths_of_a_long_chain_take_a_few_passes_not_one_per_level():
    n = 50_000
    ones = np.ones(n, dtype=np.int64)
    store = NgramStore.from_columns(
        {"token": ones.astype(np.int32), "parent": np.arange(n, dtype=np.int32), "count": ones,
         "weight": ones.astype(np.float64), "source": ones.astype(np.uint8)}
    )  # fmt: skip
    start = time.perf_counter()
    depths = store.depths()
    assert time.perf_counter() - start < 1.0  # a pass per level took seconds here, a minute at 200,000
    assert depths.tolist() == list(range(n + 1))


def test_bad_token_ids_are_refused():
    trie = TokenTrie()
    with pytest.raises(ValueError, match="token ids"):
        trie.observe("r", [-1])
    with pytest.raises(ValueError, match="token ids"):
        trie.insert([1 << 24])


# ---- persistence -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(token_lists, min_size=1, max_size=6), st.lists(token_lists, min_size=1, max_size=5))
def test_load_of_save_drafts_the_same(tmp_path_factory, outputs, contexts):
    trie = TokenTrie(ngram_length=5, max_nodes=50, half_life=20.0, boundary_ids=[0])
    for i, tokens in enumerate(outputs):
        trie.observe(i, tokens)
        trie.finish(i)
    path = tmp_path_factory.mktemp("t") / "trie.bin"
    trie.save(path)
    loaded = TokenTrie.load(path)
    assert _ngrams(loaded._shared) == _ngrams(trie._shared)
    _check_structure(loaded._shared)
    for context in contexts:
        a, b = trie.retrieve(context, 8, 4), loaded.retrieve(context, 8, 4)
        assert (a.tokens, a.parents, a.scores, a.sources) == (b.tokens, b.parents, b.scores, b.sources)
    assert loaded._choices.column().tolist() == trie._choices.column().tolist()  # what the model chose: the flags
    assert (loaded.ngram_length, loaded.boundary_ids, loaded.max_nodes) == (5, frozenset([0]), 50)
    loaded.observe("x", list(range(10, 40)))  # and it goes on learning under its budget
    assert len(loaded) <= 50
    _check_structure(loaded._shared)


def test_empty_trie_round_trips(tmp_path):
    TokenTrie().save(tmp_path / "t")
    assert len(TokenTrie.load(tmp_path / "t")) == 0


@pytest.fixture
def saved(tmp_path):
    trie = TokenTrie(ngram_length=4)
    trie.observe("r", list(range(50)) * 2)
    path = tmp_path / "trie.bin"
    trie.save(path)
    return path


def test_truncated_file_is_refused(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated"):
        TokenTrie.load(saved)


@pytest.mark.parametrize("offset", [60, 200, -8])
def test_bit_flip_is_refused(saved, offset):
    data = bytearray(saved.read_bytes())
    data[offset] ^= 0x10
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted"):
        TokenTrie.load(saved)


def test_wrong_magic_and_pickle_are_refused(saved, tmp_path):
    data = saved.read_bytes()
    saved.write_bytes(b"X" + data[1:])
    with pytest.raises(ValueError, match="not a lookahead trie file"):
        TokenTrie.load(saved)
    evil = tmp_path / "evil.bin"
    evil.write_bytes(pickle.dumps({"trie": [1, 2, 3]}))
    with pytest.raises(ValueError, match="not a lookahead trie file"):
        TokenTrie.load(evil)


def test_other_version_is_refused(saved):
    data = bytearray(saved.read_bytes())
    struct.pack_into("<I", data, len(MAGIC), 99)
    saved.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="version 99"):
        TokenTrie.load(saved)


def test_a_failed_save_leaves_the_old_file(saved, monkeypatch):
    before = saved.read_bytes()
    trie = TokenTrie()
    trie.observe("r", [1, 2, 3])
    monkeypatch.setattr("lookahead.drafting.triefile.os.fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        trie.save(saved)
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no temporary file left


def test_tokenizer_identity_is_kept_and_checked(tmp_path):
    ours, theirs = FakeTokenizer({"a": 0, "b": 1}), FakeTokenizer({"a": 1, "b": 0})
    assert tokenizer_fingerprint(ours) != tokenizer_fingerprint(theirs)
    trie = TokenTrie()
    trie.bind_tokenizer(ours)
    trie.save(tmp_path / "t")
    loaded = TokenTrie.load(tmp_path / "t")
    loaded.bind_tokenizer(ours)
    with pytest.raises(ValueError, match="another tokenizer"):
        loaded.bind_tokenizer(theirs)


def test_engine_refuses_a_trie_of_another_tokenizer(tokenizer, tmp_path):
    from tiny_models import tiny_model

    from lookahead import LookaheadConfig, LookaheadEngine

    trie = TokenTrie()
    trie.bind_tokenizer(FakeTokenizer({"x": 0}))
    trie.save(tmp_path / "t")
    with pytest.raises(ValueError, match="another tokenizer"):
        LookaheadEngine(
            tiny_model("llama"), tokenizer, LookaheadConfig(policy="fixed"), trie=TokenTrie.load(tmp_path / "t")
        )
    empty = TokenTrie(max_nodes=123)
    engine = LookaheadEngine(tiny_model("llama"), tokenizer, LookaheadConfig(policy="fixed"), trie=empty)
    assert engine.trie is empty and empty.tokenizer_id == tokenizer_fingerprint(tokenizer)


def test_an_engine_follows_its_tries_recycled_table(tokenizer):
    from tiny_models import tiny_model

    from lookahead import LookaheadConfig, LookaheadEngine

    kept = TokenTrie(recycled=4)
    with pytest.warns(UserWarning, match="keeps recycled drafts \\(4 tokens a token\\)"):
        engine = LookaheadEngine(tiny_model("llama"), tokenizer, LookaheadConfig(policy="fixed"), trie=kept)
    assert engine.config.recycled == 4 and engine.verifier.following == 4
    engine.generate([5, 6, 7, 5, 6], 6)
    assert len(kept.recycled) > 0, "the trie's table learns from the engine's verdicts"
    with pytest.warns(UserWarning, match="keeps no recycled drafts"):
        engine = LookaheadEngine(tiny_model("llama"), tokenizer, LookaheadConfig(recycled=8), trie=TokenTrie())
    assert engine.verifier.following == 0, "no top-k computed for a table that is not there"


def test_a_sound_container_with_an_unsound_trie_is_refused(tmp_path):
    from lookahead.drafting.triefile import TrieSettings, write_trie

    trie = TokenTrie(ngram_length=4)
    trie.observe("r", [1, 2, 3])
    trie.save(tmp_path / "good")
    columns = trie._shared.export()
    columns["parent"][0] = 2  # the first node now claims a parent that comes after it
    settings = TrieSettings(
        ngram_length=4, boundary_ids=[], max_nodes=None, half_life=None, age=0.0, tokens_learned=3, tokenizer_id=None
    )
    write_trie(tmp_path / "bad", columns, settings)
    with pytest.raises(ValueError, match="malformed trie file"):
        TokenTrie.load(tmp_path / "bad")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_a_save_sweeps_up_only_what_killed_saves_left(tmp_path):
    target = tmp_path / "trie.bin"
    dead = _dead_pid()
    long_ago = time.time() - 2 * STALE_SCRATCH_S
    stale = tmp_path / f"trie.bin.{dead}.ab12cd_3.tmp"
    kept = {
        f"trie.bin.{os.getpid()}.ef45gh67.tmp": long_ago,  # its writer is running: a save in progress
        f"trie.bin.{dead}.ij89kl01.tmp": time.time(),  # recent: maybe a writer in another pid namespace
        f"other.bin.{dead}.mn23op45.tmp": long_ago,  # another trie's
        f"trie.bin.{dead}.tmp": long_ago,  # not a name write_trie makes
        "trie.bin.bak": long_ago,
    }
    for name, when in [(stale.name, long_ago), *kept.items()]:
        (tmp_path / name).write_bytes(b"half a trie")
        os.utime(tmp_path / name, (when, when))
    TokenTrie().save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, *kept])
    assert remove_stale_scratch(target) == []
