"""LookaheadConfig: its checks, and settings read from command-line text."""

import pytest

from lookahead.config import MAX_NGRAM_LENGTH, LookaheadConfig
from lookahead.drafting.trie import TokenTrie


def test_config_rejects_bad_settings():
    for bad in ({"decoding_length": 0}, {"branch_length": -1}, {"match_length": 0}, {"policy": "psychic"},
                {"min_score": 1.5}, {"decoding_length": True}, {"linears": "fast"}, {"direct_layers": 1}):  # fmt: skip
        with pytest.raises(ValueError, match="LookaheadConfig"):
            LookaheadConfig(**bad)


def test_ngram_length_is_bounded_for_configs_and_tries():
    assert LookaheadConfig(match_length=4, branch_length=252).ngram_length == MAX_NGRAM_LENGTH
    with pytest.raises(ValueError, match=r"LookaheadConfig.match_length \+ branch_length .* from 2 to 256, got 257"):
        LookaheadConfig(match_length=4, branch_length=253)
    for bad in (1, 257, 1_000_000, 12.0, 2.5, True, "12"):
        with pytest.raises(ValueError, match="ngram_length must be an integer from 2 to 256"):
            TokenTrie(ngram_length=bad)
    for name, bad in (("max_nodes", 10.0), ("max_nodes", True), ("half_life", float("inf")), ("half_life", True)):
        with pytest.raises(ValueError, match=f"{name} must be positive or None"):
            TokenTrie(**{name: bad})


def test_parse_reads_each_setting_as_its_type():
    config = LookaheadConfig.parse("trie_max_nodes=100000,trie_half_life=100,min_score=0.25,policy=fixed")
    assert config.trie_max_nodes == 100_000 and isinstance(config.trie_max_nodes, int)
    assert config.trie_half_life == 100.0 and isinstance(config.trie_half_life, float)
    assert config.min_score == 0.25 and config.policy == "fixed"
    assert LookaheadConfig.parse("trie_max_nodes=none, trie_half_life=None").trie_max_nodes is None
    assert LookaheadConfig.parse("decoding_length=8").decoding_length == 8


@pytest.mark.parametrize(
    ("text", "named"),
    [("trie_max_nodes=1.5", "trie_max_nodes"), ("trie_half_life=soon", "trie_half_life"),
     ("decoding_length=none", "decoding_length"), ("colour=3", "colour"), ("branch_length", "branch_length"),
     ("trie_half_life=-2", "trie_half_life"), ("min_score=nan", "min_score"),
     ("direct_layers=maybe", "direct_layers")],
)  # fmt: skip
def test_parse_names_the_bad_setting(text, named):
    with pytest.raises(ValueError, match=named):
        LookaheadConfig.parse(text)
