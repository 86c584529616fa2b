from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.config import LookaheadConfig
from lookahead.draft import DraftTree
from lookahead.policy import Calibration, CostModel, DraftPolicy, DraftSession, best_prefix
from lookahead.trie import TokenTrie

FLAT = CostModel({1: 50.0, 64: 50.0})
STEEP = CostModel({1: 50.0, 2: 100.0, 64: 3200.0})
CPU_LIKE = CostModel({1: 56.0, 8: 77.0, 16: 91.0, 32: 117.0, 64: 172.0})  # SmolLM2 on 2 cores


def test_flat_cost_takes_the_whole_budget():
    assert best_prefix([0.3] * 40, FLAT) == 40
    assert best_prefix([0.01] * 63, FLAT) == 63


def test_steep_cost_and_low_probabilities_take_nothing():
    assert best_prefix([0.2] * 20, STEEP) == 0
    assert best_prefix([0.02] * 20, CPU_LIKE) == 0


def test_a_cpu_takes_a_confident_chain_but_not_a_doubtful_bush():
    assert best_prefix([0.95, 0.9, 0.85, 0.8, 0.75, 0.7], CPU_LIKE) == 6
    assert best_prefix([0.04] * 4 + [0.01] * 60, CPU_LIKE) == 0


probabilities = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40).map(lambda ps: sorted(ps, reverse=True))


@settings(max_examples=200, deadline=None)
@given(probabilities, st.floats(0.0, 0.5))
def test_more_confidence_never_sends_fewer_nodes(ps, boost):
    higher = [min(1.0, p + boost) for p in ps]
    assert best_prefix(higher, CPU_LIKE) >= best_prefix(ps, CPU_LIKE)


@settings(max_examples=200, deadline=None)
@given(probabilities, st.floats(1.0, 5.0))
def test_steeper_cost_never_sends_more_nodes(ps, factor):
    steeper = CostModel({w: 56.0 + (ms - 56.0) * factor for w, ms in zip(CPU_LIKE.widths, CPU_LIKE.base, strict=True)})
    assert best_prefix(ps, steeper) <= best_prefix(ps, CPU_LIKE)


def test_cost_model_interpolates_and_follows_drift():
    cost = CostModel({"1": 10.0, "9": 26.0})
    assert cost.predict(5) == 18.0 and cost.predict(17) == 42.0
    for _ in range(200):
        cost.observe(5, 36.0)  # the machine became twice as slow
    assert abs(cost.predict(5) - 36.0) < 0.5
    cost.observe(5, 10_000.0)  # an outlier (a pause) is ignored
    assert abs(cost.predict(5) - 36.0) < 0.5


def test_calibration_learns_observed_acceptance():
    calibration = Calibration()
    assert abs(calibration.probability(0.85) - 0.85) < 1e-9
    for _ in range(500):
        calibration.update([0.85, 0.85], accepted=[])  # the trie was over-confident
    assert calibration.probability(0.85) < 0.05
    for _ in range(500):
        calibration.update([0.15], accepted=[1])  # and under-confident here
    assert calibration.probability(0.15) > 0.95


def test_sessions_cut_the_tree_by_policy():
    trie = TokenTrie(ngram_length=8)
    for _ in range(3):
        trie.insert([1, 2, 3, 4, 5, 6])
    trie.insert([1, 9, 8, 7])
    config = LookaheadConfig(decoding_length=8, branch_length=6)
    fixed = DraftSession(trie, config, [], DraftPolicy())
    assert len(fixed.propose([1], 100, branching=True)) == 8
    steep = DraftSession(trie, config, [], DraftPolicy(STEEP))
    assert len(steep.propose([1], 100, branching=True)) == 0
    flat = DraftSession(trie, config, [], DraftPolicy(FLAT))
    tree = flat.propose([1], 100, branching=True)
    assert len(tree) == 8 and isinstance(tree, DraftTree)


def test_config_rejects_bad_settings():
    import pytest

    for bad in ({"decoding_length": 0}, {"branch_length": -1}, {"match_length": 0}, {"policy": "psychic"},
                {"min_score": 1.5}):  # fmt: skip
        with pytest.raises(ValueError, match="LookaheadConfig"):
            LookaheadConfig(**bad)
