from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead.drafting.ngrams import FOLLOWED, OUTPUT, OVERRULED, PROMPT, RECYCLED
from lookahead.drafting.policy import (
    DEPTH_BINS,
    OVERRULED_PRIOR,
    Calibration,
    CostModel,
    DraftPolicy,
    Level,
    best_sizes,
    best_width,
    floor_factors,
    least_gain,
    step_width,
)
from lookahead.drafting.tree import DraftTree

FLAT = CostModel({1: 50.0, 64: 50.0})
STEEP = CostModel({1: 50.0, 2: 100.0, 64: 3200.0})
CPU_LIKE = CostModel({1: 56.0, 8: 77.0, 16: 91.0, 32: 117.0, 64: 172.0})  # SmolLM2 on 2 cores


def test_flat_cost_takes_the_whole_budget():
    assert best_width([[0.3] * 40], FLAT) == 40
    assert best_width([[0.01] * 63], FLAT) == 63


def test_steep_cost_and_low_probabilities_take_nothing():
    assert best_width([[0.2] * 20], STEEP) == 0
    assert best_width([[0.02] * 20], CPU_LIKE) == 0


def test_a_cpu_takes_a_confident_chain_but_not_a_doubtful_bush():
    assert best_width([[0.95, 0.9, 0.85, 0.8, 0.75, 0.7]], CPU_LIKE) == 6
    assert best_width([[0.04] * 4 + [0.01] * 60], CPU_LIKE) == 0


probabilities = st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40).map(lambda ps: sorted(ps, reverse=True))


@settings(max_examples=200, deadline=None)
@given(probabilities, st.floats(0.0, 0.5))
def test_more_confidence_never_sends_fewer_nodes(ps, boost):
    higher = [min(1.0, p + boost) for p in ps]
    assert best_width([higher], CPU_LIKE) >= best_width([ps], CPU_LIKE)


@settings(max_examples=200, deadline=None)
@given(probabilities, st.floats(1.0, 5.0))
def test_steeper_cost_never_sends_more_nodes(ps, factor):
    steeper = CostModel({w: 56.0 + (ms - 56.0) * factor for w, ms in zip(CPU_LIKE.widths, CPU_LIKE.base, strict=True)})
    assert best_width([ps], steeper) <= best_width([ps], CPU_LIKE)


def _above_floors(chances: list[float], floors: np.ndarray) -> int:
    """How many of `chances` (best first) a retrieval with these floors keeps: up to the first under its floor."""
    taken = 1.0
    for place, chance in enumerate(chances):
        if chance < taken * floors[place]:
            return place
        taken += chance
    return len(chances)


def test_floors_worked_example():
    floors = floor_factors([10.0, 17.0, 24.0])
    np.testing.assert_allclose(floors, [0.7, 24 / 17 - 1])
    assert _above_floors([0.69, 0.6], floors) == 0
    assert _above_floors([0.8, 0.5], floors) == 1  # 0.5 < 0.41 * 1.8
    assert best_width([[0.8, 0.5]], CostModel({1: 10.0, 2: 17.0, 3: 24.0})) <= 1


costs = st.lists(st.floats(1.0, 500.0), min_size=2, max_size=16)


@settings(max_examples=400, deadline=None)
@given(probabilities, costs)
def test_a_one_row_step_never_sends_a_node_under_its_floor(ps, curve):
    """Whatever the curve (rising, flat, or cheaper for some wider blocks, as BLAS makes it), the floors only
    leave out nodes the policy would not send, so a retrieval that stops at them changes no decision."""
    cost = CostModel(dict(enumerate(curve, start=1)))
    ps = ps[: len(curve) - 1]
    floors = floor_factors(cost.predict_widths(range(1, len(ps) + 2)))
    kept = _above_floors(ps, floors)
    assert best_width([ps], cost) <= kept
    assert best_width([ps[:kept]], cost) == best_width([ps], cost)


def test_flat_costs_have_no_floor():
    assert not floor_factors(FLAT.predict_widths(range(1, 33))).any()


def test_cost_model_interpolates_and_follows_drift():
    cost = CostModel({"1": 10.0, "9": 26.0})
    assert cost.predict(5) == 18.0 and cost.predict(17) == 42.0
    for _ in range(200):
        cost.observe(5, 36.0)  # the machine became twice as slow
    assert abs(cost.predict(5) - 36.0) < 0.5
    cost.observe(5, 10_000.0)  # an outlier (a pause) is ignored
    assert abs(cost.predict(5) - 36.0) < 0.5


def path_probabilities(tree: DraftTree, rates: np.ndarray) -> np.ndarray:
    """Chance that each node is accepted: its cell's rate times its parent's chance."""
    step = rates[Calibration.cells(tree)]
    chance = np.ones(len(tree) + 1)
    for node, parent in enumerate(tree.parents):
        chance[node + 1] = chance[parent] * step[node]
    return chance[1:]


PROMPT_CHAIN = DraftTree(tokens=[5, 6, 7], parents=[0, 1, 2], ratios=[0.9, 1.0, 1.0], sources=[PROMPT] * 3)
OUTPUT_CHAIN = DraftTree(tokens=[5, 6, 7], parents=[0, 1, 2], ratios=[0.9, 1.0, 1.0], sources=[OUTPUT] * 3)
PRIOR = Calibration.trie_prior()


def _observe(calibration: Calibration, tree: DraftTree, accepted: list[int]) -> None:
    calibration.record(*Calibration.observations(tree, accepted)[:2])


def test_calibration_starts_from_the_trie_and_learns_per_source():
    engine = Calibration(weight=2.0)
    before = path_probabilities(PROMPT_CHAIN, engine.rates(PRIOR))
    assert np.allclose(before, [0.9, 0.81, 0.729])  # edge ratios 0.9, 1, 1: the top bin, midpoint 0.9
    for _ in range(300):
        _observe(engine, PROMPT_CHAIN, [1, 2, 3])  # copies from the prompt hold
        _observe(engine, OUTPUT_CHAIN, [])  # the same counts from other answers do not
    rates = engine.rates(PRIOR)
    assert path_probabilities(PROMPT_CHAIN, rates)[-1] > 0.98
    assert path_probabilities(OUTPUT_CHAIN, rates)[0] < 0.02


def test_a_chain_continuing_a_longer_match_is_calibrated_apart():
    engine = Calibration(weight=2.0)
    one, four = replace(OUTPUT_CHAIN, matched=1), replace(OUTPUT_CHAIN, matched=4)
    for _ in range(300):
        _observe(engine, four, [1, 2, 3])  # after four tokens matched, an earlier answer's continuation holds
        _observe(engine, one, [])  # after one, the same counts do not
    rates = engine.rates(PRIOR)
    assert path_probabilities(four, rates)[-1] > 0.98 and path_probabilities(one, rates)[0] < 0.02
    assert np.array_equal(Calibration.cells(replace(four, matched=9)), Calibration.cells(four))  # 4 or more: one bin
    assert np.array_equal(Calibration.cells(replace(one, matched=0)), Calibration.cells(one))


def test_a_continuation_seen_once_is_calibrated_apart_from_one_seen_often():
    engine = Calibration(weight=2.0)
    once, often = replace(OUTPUT_CHAIN, seen=[1, 1, 1]), replace(OUTPUT_CHAIN, seen=[6, 6, 6])
    for _ in range(300):
        _observe(engine, often, [1, 2, 3])  # an n-gram several answers share holds
        _observe(engine, once, [])  # the same ratios from one sighting do not
    rates = engine.rates(PRIOR)
    assert path_probabilities(often, rates)[-1] > 0.98 and path_probabilities(once, rates)[0] < 0.02
    assert np.array_equal(Calibration.cells(replace(often, seen=[2, 9, 0])), Calibration.cells(often))  # 0: unknown
    assert PRIOR[Calibration.cells(once)].tolist() == PRIOR[Calibration.cells(often)].tolist()  # both tried at first


def test_what_the_model_last_chose_after_the_parent_is_calibrated_apart_and_an_overruled_node_starts_doubted():
    engine = Calibration(weight=2.0)
    followed, overruled = (replace(OUTPUT_CHAIN, sources=[OUTPUT | flag] * 3) for flag in (FOLLOWED, OVERRULED))
    for _ in range(300):
        _observe(engine, followed, [1, 2, 3])  # where the model chose the drafted token last time, it holds
        _observe(engine, overruled, [])  # where it chose another, it does not
    rates = engine.rates(PRIOR)
    assert path_probabilities(followed, rates)[-1] > 0.98 and path_probabilities(overruled, rates)[0] < 0.02
    assert rates[Calibration.cells(OUTPUT_CHAIN)].tolist() == PRIOR[Calibration.cells(OUTPUT_CHAIN)].tolist()
    assert PRIOR[Calibration.cells(followed)].tolist() == PRIOR[Calibration.cells(OUTPUT_CHAIN)].tolist()
    assert np.allclose(PRIOR[Calibration.cells(overruled)], OVERRULED_PRIOR * PRIOR[Calibration.cells(OUTPUT_CHAIN)])
    recycled = DraftTree(tokens=[5], parents=[0], ratios=[1.0], sources=[RECYCLED | FOLLOWED])
    assert (
        Calibration.cells(recycled)[0] == Calibration.cells(replace(recycled, sources=[RECYCLED]))[0] + 1
    )  # still recycled


def test_only_nodes_whose_parent_was_accepted_are_counted():
    engine = Calibration(weight=2.0)
    for _ in range(300):
        _observe(engine, OUTPUT_CHAIN, [1])  # the first holds, the second fails, the third is never tried
    first, second = Calibration.cells(OUTPUT_CHAIN)[:2]
    assert engine.sent[first] == engine.sent[second] and engine.accepted[second] == 0
    assert Calibration.cells(OUTPUT_CHAIN)[2] == second and engine.rates(PRIOR)[second] < 0.02


def test_a_request_learns_its_own_rate_within_a_few_steps():
    engine = Calibration(weight=2.0)
    for _ in range(500):
        _observe(engine, PROMPT_CHAIN, [])  # most requests do not copy their prompt
    request = Calibration(weight=8.0)
    for _ in range(20):
        _observe(request, PROMPT_CHAIN, [1, 2, 3])  # this one does
    assert path_probabilities(PROMPT_CHAIN, request.rates(engine.rates(PRIOR)))[0] > 0.65


def test_old_observations_fade():
    engine = Calibration(weight=2.0)
    for _ in range(3000):
        _observe(engine, OUTPUT_CHAIN, [])
    assert engine.sent.max() <= Calibration.HALVE_AT
    for _ in range(1000):
        _observe(engine, OUTPUT_CHAIN, [1])  # the traffic changed
    assert engine.rates(PRIOR)[Calibration.cells(OUTPUT_CHAIN)[0]] > 0.6


def test_fit_sends_the_likeliest_prefix_worth_its_cost():
    # likeliest first, as the trie lists them: the prompt chain (3 -> 4), then a doubtful output branch (1 -> 2)
    tree = DraftTree(tokens=[3, 4, 1, 2], parents=[0, 1, 0, 3], chances=[0.95, 0.9025, 0.5, 0.475])
    chosen = DraftPolicy(CostModel({1: 50.0, 3: 65.0, 5: 250.0})).fit([tree])[0]
    assert chosen.tokens == [3, 4] and chosen.parents == [0, 1]  # the prompt chain, not the output branch
    assert DraftPolicy(FLAT).fit([tree])[0].tokens == tree.tokens
    assert DraftPolicy().fit([tree])[0] is tree, "a fixed policy sends everything"


BATCH = CostModel({1: 56.0, 8: 77.0, 16: 91.0, 32: 117.0}, batched={8: {1: 97.0, 4: 190.0, 8: 269.0, 16: 418.0}})


def test_cost_model_interpolates_between_measured_row_counts():
    assert BATCH.rows == [1, 8]
    assert BATCH.predict(8) == pytest.approx(77.0, rel=0.05) and BATCH.predict(8, rows=8) == pytest.approx(
        269.0, rel=0.05
    )
    four = BATCH.predict(8, rows=4)
    assert BATCH.predict(8, rows=1) < four < BATCH.predict(8, rows=8)
    assert BATCH.predict(8, rows=16) > BATCH.predict(8, rows=8), "past the largest measured count: extrapolated"
    busy = CostModel({1: 56.0, 32: 117.0}, batched={8: {1: 97.0, 16: 418.0}})  # BATCH is shared: not changed here
    busy.observe(1, 2 * busy.predict(1, rows=8), rows=8)
    assert busy.scale > 1.0


def test_flat_cost_sends_drafts_for_every_row():
    flat = CostModel({1: 50.0, 64: 50.0}, batched={8: {1: 60.0, 64: 60.0}})
    trees = [DraftTree([1, 2, 3], [0, 1, 2], chances=[0.3, 0.2, 0.1]) for _ in range(8)]
    assert [len(tree) for tree in DraftPolicy(flat).fit(trees)] == [3] * 8


def test_steep_cost_and_low_chances_mean_plain_batched_decoding():
    trees = [DraftTree([1, 2], [0, 1], chances=[0.2, 0.05]) for _ in range(8)]
    assert [len(tree) for tree in DraftPolicy(BATCH).fit(trees)] == [0] * 8


def test_the_likeliest_rows_decide_the_width_and_the_others_fill_it():
    sure = DraftTree([1, 2, 3, 4], [0, 1, 2, 3], chances=[0.99, 0.98, 0.97, 0.96])
    doubtful = DraftTree([5, 6, 7, 8], [0, 1, 2, 3], chances=[0.05, 0.02, 0.01, 0.01])
    assert [len(t) for t in DraftPolicy(BATCH).fit([doubtful] * 8)] == [0] * 8
    fitted = DraftPolicy(BATCH).fit([sure] * 4 + [doubtful] * 4)
    assert len(fitted[0]) > 0, "rows that copy text earn the width"
    assert {len(t) for t in fitted} == {len(fitted[0])}, "the other rows pay for that width anyway: they fill it"


def _packed(cost: CostModel) -> DraftPolicy:
    policy = DraftPolicy(cost)
    policy.packed = True
    return policy


def test_a_packed_batch_gives_the_budget_to_the_rows_whose_drafts_are_likeliest():
    sure = DraftTree([1, 2, 3, 4], [0, 1, 2, 3], chances=[0.99, 0.98, 0.97, 0.96])
    doubtful = DraftTree([5, 6, 7, 8], [0, 1, 2, 3], chances=[0.05, 0.02, 0.01, 0.01])
    fitted = _packed(BATCH).fit([sure] * 2 + [doubtful] * 6)
    assert [len(t) for t in fitted] == [4, 4, 0, 0, 0, 0, 0, 0], "each row pays for its own nodes only"
    assert [len(t) for t in _packed(BATCH).fit([doubtful] * 8)] == [0] * 8, "steep cost, low chances: plain"
    flat = CostModel({1: 50.0, 64: 50.0}, batched={8: {1: 60.0, 64: 60.0}})
    assert [len(t) for t in _packed(flat).fit([doubtful] * 8)] == [4] * 8, "flat cost: every row drafts"


def test_packed_sizes_are_prefixes_even_where_a_later_node_is_likelier():
    chances = [[0.3, 0.9, 0.9], [0.5]]  # row 0's likely nodes come only after its doubtful first one
    flat = CostModel({1: 50.0, 64: 50.0}, batched={2: {1: 50.0, 64: 50.0}})
    assert best_sizes(chances, flat) == [3, 1]
    one_node = CostModel({1: 50.0, 2: 60.0, 3: 70.0, 64: 100.0}, batched={2: {1: 100.0, 2: 130.0, 3: 400.0, 64: 5e3}})
    assert best_sizes(chances, one_node) == [0, 1], "worth one node: row 1's, not row 0's 0.9 behind its 0.3"


def test_one_packed_row_is_priced_as_a_padded_one():
    for values in ([0.9, 0.5, 0.3, 0.1], [0.2] * 20, [0.99] * 40):
        assert best_sizes([values], CPU_LIKE) == [best_width([values], CPU_LIKE)]
    trees = [DraftTree([1, 2], [0, 1]), DraftTree()]
    assert step_width(trees, packed=False) == 3 and step_width(trees, packed=True) == 2.0


def test_steps_of_one_size_correct_that_size_and_not_the_shape_of_the_others():
    cost = CostModel({1: 50.0, 8: 60.0}, batched={8: {1: 100.0, 4: 110.0, 8: 160.0}})
    for _ in range(30):  # 8 rows of 4 run at twice the measurement; 8 rows of 1 as measured
        cost.observe(4, 220.0, rows=8)
        cost.observe(1, 100.0, rows=8)
    assert cost.predict(4, rows=8) == pytest.approx(220.0, rel=0.1)
    assert cost.predict(1, rows=8) == pytest.approx(100.0, rel=0.1)
    assert cost.predict(3, rows=8) == pytest.approx(2 * cost.measured(3, rows=8), rel=0.1), "3 and 4 share a bucket"
    assert cost.predict(2) == pytest.approx(cost.measured(2)), "plain steps ran as measured: so do unseen sizes"
    for _ in range(100):
        cost.observe(1, 150.0, rows=8)  # the machine got busier
    assert cost.predict(2) == pytest.approx(1.5 * cost.measured(2), rel=0.05)


def test_a_wide_size_never_tried_is_priced_like_its_narrower_neighbours():
    cost = CostModel({1: 50.0, 8: 60.0}, batched={8: {1: 100.0, 4: 110.0, 16: 200.0}})
    for _ in range(30):  # 8 rows of 3-4 tokens run at 1.5x their measurement, plain steps as measured
        cost.observe(4, 165.0, rows=8)
        cost.observe(1, 100.0, rows=8)
    assert cost.predict(16, rows=8) == pytest.approx(1.5 * cost.measured(16, rows=8), rel=0.1)
    assert cost.predict(1, rows=8) == pytest.approx(100.0, rel=0.05), "narrower sizes keep their own"
    assert cost.predict(16, rows=2) == pytest.approx(1.5 * cost.measured(16, rows=2), rel=0.1), "nor other rows"


def test_a_row_count_not_seen_yet_expects_what_its_width_showed_at_other_row_counts():
    """A closed batch's tail: rows leave one by one, so each row count's first drafting steps are priced by the
    width's record at the counts before it, not by plain steps' factor."""
    cost = CostModel({1: 50.0, 8: 60.0}, batched={8: {1: 100.0, 4: 110.0, 16: 200.0}})
    for _ in range(30):  # 8 rows: drafting steps at 1.4x their measurement, plain ones as measured
        cost.observe(4, 1.4 * cost.measured(4, rows=8), rows=8)
        cost.observe(1, 100.0, rows=8)
    assert cost.predict(4, rows=3) == pytest.approx(1.4 * cost.measured(4, rows=3), rel=0.05)
    assert cost.predict(1, rows=3) == pytest.approx(cost.measured(1, rows=3), rel=0.05), "plain as plain ran"
    for _ in range(30):  # then 3 rows' own drafting steps run as measured: their own evidence wins
        cost.observe(4, cost.measured(4, rows=3), rows=3)
    assert cost.predict(4, rows=3) == pytest.approx(cost.measured(4, rows=3), rel=0.1)


def test_a_wider_size_that_ran_cheaper_than_a_narrower_one_is_not_priced_under_it():
    cost = CostModel({1: 50.0, 8: 60.0}, batched={8: {1: 100.0, 4: 110.0, 16: 200.0}})
    for _ in range(30):  # 8 rows of 5-8 tokens ran at 1.3x their price, of 9-16 and plain steps as measured
        cost.observe(6, 1.3 * cost.measured(6, rows=8), rows=8)
        cost.observe(12, cost.measured(12, rows=8), rows=8)
        cost.observe(1, cost.measured(1, rows=8), rows=8)
    widths = (8 + np.arange(8 * 16 + 1)) / 8  # every packed size of 8 rows up to 16 nodes each
    assert (np.diff(cost.predict_widths(widths, rows=8)) >= 0).all(), "a step's price never falls with its nodes"
    factor_5_to_8 = cost.predict(6, rows=8) / cost.measured(6, rows=8)
    assert cost.predict(12, rows=8) == pytest.approx(factor_5_to_8 * cost.measured(12, rows=8))
    assert min(_packed(cost).least(8, 16)) > 0, "so a packed step's rows have a floor to retrieve by"


def test_an_underpriced_width_is_learnt_and_then_not_chosen():
    cost = CostModel({1: 50.0, 8: 60.0}, batched={8: {1: 100.0, 4: 105.0, 8: 160.0}})
    policy = DraftPolicy(cost)
    trees = [DraftTree([1, 2, 3], [0, 1, 2], chances=[0.4, 0.2, 0.1]) for _ in range(8)]
    assert len(policy.fit(trees)[0]) == 3, "measured as nearly free: drafts for every row"
    for _ in range(20):  # any drafting step takes twice its price, plain steps what they cost
        sent = policy.fit(trees)
        policy.observe(sent, 210.0 if len(sent[0]) else 100.0)
    assert [len(tree) for tree in policy.fit(trees)] == [0] * 8


def test_batched_steps_after_a_long_context_are_priced_as_measured():
    # SmolLM2 in float32 on 2 cores: one row, and 8 packed rows of chains, after 128 and 1,400 cached tokens
    one_row, after_1400 = {1: 31.2, 4: 43.3, 8: 50.0, 32: 75.6}, {1: 36.3, 4: 51.3, 8: 60.4, 32: 95.3}
    cost = CostModel(one_row, batched={8: {1: 55.3, 2: 62.9, 4: 80.3, 8: 117.7}}, contexts={1400: after_1400})
    measured_8_rows = {1: 91.9, 2: 100.0, 4: 134.3, 8: 187.9}  # (the one-row ratio priced them 64-142 ms)
    for width, ms in measured_8_rows.items():
        assert 0.95 * ms <= cost.predict(width, rows=8, context=1400) <= 1.15 * ms, "within 15 %, rather above"


def test_long_contexts_are_priced_by_their_own_curves():
    cost = CostModel({1: 10.0, 64: 20.0}, contexts={4096: {1: 30.0, 64: 60.0}})
    assert cost.contexts == [128, 4096]
    assert cost.predict(1) == 10.0 and cost.predict(1, context=4096) == pytest.approx(30.0)
    assert cost.predict(64, context=2112) == pytest.approx(40.0), "halfway between the measured lengths"
    assert cost.predict(1, context=8064) == pytest.approx(50.0), "past the longest: attention reads every token"
    batched = CostModel({1: 10.0, 64: 20.0}, batched={8: {1: 40.0, 64: 80.0}}, contexts={4096: {1: 30.0, 64: 60.0}})
    assert batched.predict(1, rows=8, context=4096) == pytest.approx(40.0 + 8 * 20.0), "each row reads its cache"
    assert batched.predict(64, rows=8, context=4096) == pytest.approx(80.0 + 8 * 40.0)
    noisy = CostModel({1: 10.0, 64: 20.0}, batched={8: {1: 40.0, 64: 80.0}}, contexts={4096: {1: 9.5, 64: 21.0}})
    assert noisy.predict(1, rows=8, context=4096) == 40.0, "a long context measured a little cheaper adds nothing"
    for _ in range(50):
        cost.observe(1, 60.0, context=4096)  # twice the measurement, seen at a long context
    assert cost.predict(1) == pytest.approx(20.0, rel=0.1), "the correction is by size, whatever the context"


def test_a_request_whose_drafts_fail_stops_drafting_within_a_few_steps_and_recovers():
    policy = DraftPolicy(CPU_LIKE)
    request = policy.request_rates()
    chain = DraftTree([5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5], ratios=[1.0] * 6, sources=[PROMPT] * 6)

    def sent() -> DraftTree:
        rates = policy.rates(request)
        chances = np.cumprod(rates[Calibration.cells(chain)]).tolist()
        return policy.fit([DraftTree(chain.tokens, chain.parents, chain.ratios, chain.sources, chances)])[0]

    assert len(sent()) == 6, "a fresh engine tries a chain copied from the prompt"
    sizes = []
    while len(tree := sent()) and len(sizes) < 20:
        sizes.append(len(tree))
        policy.learn(tree, [], request)  # its first node fails every time
    assert sizes[3] <= 3 and len(sizes) <= 10, f"the request backs off within a few failed steps: {sizes}"
    for _ in range(3):
        policy.learn(chain, [1, 2, 3, 4, 5, 6], request)  # then copies hold (as a replay shows, whatever was sent)
    assert len(sent()) == 6, "and it drafts again once they do"


def test_a_closed_batch_values_a_row_by_its_chance_of_ending_last():
    policy = _packed(BATCH)
    rows = 8
    even = policy.worth([1 / rows] * rows)
    assert even == pytest.approx([BATCH.predict(1, rows) / rows] * rows), "alike: a step's price over its rows"
    ahead = policy.worth([0.0] + [1 / (rows - 1)] * (rows - 1))
    share = (BATCH.predict(1, rows) - BATCH.predict(1, 1)) / (rows - 1)
    assert ahead[0] == pytest.approx(share), "a row that ends early saves only its share of the steps it leaves"
    assert list(ahead[1:]) == pytest.approx(list(even[1:])), "and none counts for more than in an open batch"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 1.0), max_size=6), min_size=2, max_size=5), st.integers(-6, 6))
def test_rows_worth_alike_send_what_unweighted_rows_send(chances, power):
    scale = 2.0**power  # exact: a scaled chance ties where the chance does
    chances = [sorted(row, reverse=True) for row in chances]
    alike = [scale] * len(chances)
    assert best_sizes(chances, BATCH, worth=alike) == best_sizes(chances, BATCH)
    assert best_width(chances, BATCH, worth=alike) == best_width(chances, BATCH)


CPU_LIKE_BATCH = CostModel({1: 60.0, 2: 62.0, 4: 66.0, 8: 75.0}, batched={4: {1: 72.0, 2: 84.0, 4: 108.0, 8: 156.0}})
"""Each draft node ~3 ms, a row's share of a plain step ~4 ms, a step alone 60 ms."""


def test_rows_sure_to_end_first_draft_less_than_in_an_open_batch():
    likely = DraftTree([1, 2, 3], [0, 1, 2], chances=[0.95, 0.6, 0.4])
    open_batch = _packed(CPU_LIKE_BATCH).fit([likely] * 4)
    closed = _packed(CPU_LIKE_BATCH).fit([likely] * 4, last=[0.0, 0.0, 0.0, 1.0])
    assert [len(tree) for tree in open_batch] == [3, 3, 3, 3]
    assert [len(tree) for tree in closed] == [1, 1, 1, 3], "rows ending early: only their likeliest node"
    idle_last = _packed(CPU_LIKE_BATCH).fit([likely] * 3 + [DraftTree()], last=[0.0, 0.0, 0.0, 1.0])
    assert [len(tree) for tree in idle_last] == [2, 2, 2, 0], "nothing from the last row: more of theirs pay"


def test_least_gain_worked_example():
    assert least_gain([100.0, 102.0, 104.0, 112.0]) == pytest.approx(0.02)
    assert least_gain([60.0 + 3 * m for m in range(40)]) == pytest.approx(3 / 60), "straight: a node's price share"
    assert least_gain([50.0, 50.0, 50.0]) == 0.0, "a flat curve: any node may be sent"
    assert least_gain([50.0, 40.0, 45.0]) == 0.0, "a wider step priced cheaper: no floor"


def _least_gain_by_every_pair(costs: list[float]) -> float:
    """least_gain's definition, pair by pair: the reference for its walk over the curve's bends."""
    floors = []
    for i in range(len(costs)):
        for m in range(i + 1, len(costs)):
            s = (costs[m] / costs[i] - 1) / (m - i)
            if i * s < 1:  # else no node could sit there
                floors.append(max(s / (1 - i * s), 0.0))
    return min(floors, default=0.0)


rising = st.lists(st.floats(0.1, 60.0), min_size=1, max_size=12).map(lambda steps: np.cumsum([40.0, *steps]).tolist())
"""Price curves that rise with every node, where a floor bites (a curve that dips somewhere has none)."""


@settings(max_examples=300, deadline=None)
@given(st.one_of(rising, st.lists(st.floats(1.0, 500.0), min_size=1, max_size=40)))
def test_least_gain_is_the_least_over_every_pair(curve):
    assert least_gain(curve) == pytest.approx(_least_gain_by_every_pair(curve), rel=1e-6, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(1.0, 100.0), min_size=2, max_size=6).map(lambda steps: np.cumsum([30.0, *steps])),
    st.integers(1, 16),
)
def test_least_gain_on_a_measured_curve_sampled_finely_is_the_least_over_every_pair(knots, rows):
    """What a packed step asks: a curve of a few measured widths, read at every node count of `rows` rows."""
    widths = (rows + np.arange(rows * (len(knots) - 1) + 1)) / rows
    curve = np.interp(widths, np.arange(1, len(knots) + 1), knots).tolist()
    assert least_gain(curve) == pytest.approx(_least_gain_by_every_pair(curve), rel=1e-6, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(probabilities.map(lambda ps: ps[:6]), min_size=2, max_size=5),
    st.one_of(rising, st.lists(st.floats(1.0, 500.0), min_size=2, max_size=8)),
    st.lists(st.floats(0.01, 1.0), min_size=5, max_size=5) | st.none(),
)
def test_a_packed_step_never_sends_a_node_under_its_rows_least_chance(chances, curve, last):
    """Whatever the curve and the rows' worths, dropping every node under its row's least chance (what retrieval
    does) changes nothing the packed step sends."""
    rows = len(chances)
    cost = CostModel({1: 50.0, 64: 60.0}, batched={rows: dict(enumerate(curve, start=1))})
    policy = _packed(cost)
    last = None if last is None else [value / sum(last[:rows]) for value in last[:rows]]
    least = policy.least(rows, 6, last=last)
    trees = [DraftTree(list(range(len(ps))), list(range(len(ps))), chances=ps) for ps in chances]
    kept = [tree.prefix(sum(p >= floor for p in tree.chances)) for tree, floor in zip(trees, least, strict=True)]
    sent = [len(tree) for tree in policy.fit(trees, last=last)]
    assert all(size <= len(tree) for size, tree in zip(sent, kept, strict=True))
    assert [len(tree) for tree in policy.fit(kept, last=last)] == sent


def test_on_a_straight_price_the_least_chance_is_where_a_node_breaks_even():
    straight = CostModel({1: 60.0, 64: 60.0}, batched={2: {1: 60.0, 2: 66.0, 8: 102.0, 64: 438.0}})  # 3 ms a node
    policy = _packed(straight)
    assert policy.least(2, 8) == pytest.approx([2 * 3 / 60] * 2), "two rows' tokens against one node's price"
    above, below = DraftTree([1], [0], chances=[0.11]), DraftTree([2], [0], chances=[0.09])
    assert [len(tree) for tree in policy.fit([above, below])] == [1, 0]


def test_least_chances_cut_what_a_batch_retrieves_and_hold_no_row_alone():
    policy = _packed(CPU_LIKE_BATCH)
    least = policy.least(4, 32)
    assert least is not None and len(set(least)) == 1 and 0.01 < least[0] < 1, least
    worth = policy.least(4, 32, last=[0.0, 0.0, 0.0, 1.0])
    assert worth[3] < least[0] < worth[0], "a row likely last needs less, a row ending early more"
    assert policy.least(1, 32) is None, "a row alone has its own floors"
    assert DraftPolicy(CPU_LIKE_BATCH).least(4, 32) is None, "padded rows share a width: no floor per row"
    assert DraftPolicy(None).least(4, 32) is None


def test_a_cost_models_measurement_forgets_what_it_learned():
    cost = CostModel({1: 50.0, 8: 60.0}, batched={4: {1: 70.0, 8: 120.0}}, contexts={1024: {1: 60.0, 8: 75.0}})
    fresh = cost.measurement()
    for _ in range(20):
        cost.observe(1, 80.0)
        cost.observe(3, 110.0, rows=4, context=600)
    widths = [1.0, 2.5, 8.0, 30.0]
    for rows, context in [(1, 128), (4, 600), (2, 2000)]:
        assert cost.measurement().predict_widths(widths, rows, context) == pytest.approx(
            fresh.predict_widths(widths, rows, context)
        )
    assert cost.predict(1) > fresh.predict(1), "the model itself learned"


def test_a_level_measured_against_rates_it_does_not_scale_settles_at_their_error():
    level = Level(neutral=20.0)
    for _ in range(3000):
        level.record(accepted=0.4, expected=0.8, fade=0.998)  # rates that say 0.8 where 0.4 is accepted
    assert level.value == pytest.approx(0.5, abs=0.03), "at their error, but for the neutral evidence"


def test_what_every_request_fails_lowers_a_fresh_requests_chances_and_what_they_copy_raises_them():
    policy = DraftPolicy(CPU_LIKE)
    cell = Calibration.cells(PROMPT_CHAIN)[0]
    fresh = policy.rates(policy.request_rates())[cell]
    assert policy.level.value == 1.0
    for _ in range(40):
        policy.learn(PROMPT_CHAIN, [], policy.request_rates())  # each a request of its own, first node failing
    assert policy.level.value < 0.9, "the cell's own rate fell as it failed, and it was sent above that"
    engine = policy.calibration.rates(PRIOR)[cell]
    assert policy.rates(policy.request_rates())[cell] == pytest.approx(engine * policy.level.value)
    assert engine * policy.level.value < engine < fresh
    for _ in range(200):
        policy.learn(PROMPT_CHAIN, [1, 2, 3], policy.request_rates())  # the traffic changed: every node holds
    assert policy.level.value > 1.0 and policy.rates(policy.request_rates())[cell] > 0.9


def test_paths_found_hopeful_deep_down_are_discounted_there_and_a_request_that_copies_them_recovers():
    chain = DraftTree(tokens=[5, 6, 7, 8, 9, 10], parents=[0, 1, 2, 3, 4, 5], sources=[PROMPT] * 6,
                      chances=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4])  # fmt: skip
    policy = DraftPolicy(CPU_LIKE)
    assert policy.path_discount(policy.request_rates()).tolist() == [1.0] * DEPTH_BINS
    for _ in range(300):
        policy.learn(chain, [1, 2], policy.request_rates())  # request after request: two nodes hold, the rest never
    fresh = policy.request_rates()
    discount = policy.path_discount(fresh)
    assert discount[:2].tolist() == [1.0, 1.0], "as likely as given, or more: never raised past the chance drafted"
    assert discount[2] < 0.2 and discount[-1] == discount[2], "a deeper node is never worth more than its parent"
    valued = replace(chain, chances=(np.asarray(chain.chances) * policy.discounted(chain, fresh)).tolist())
    assert len(policy.fit([chain])[0]) == 6 and len(policy.fit([valued])[0]) == 2
    copying = policy.request_rates()
    for _ in range(20):
        policy.learn(chain, [1, 2, 3, 4, 5, 6], copying)  # this request's text is copied: its deep paths hold
    assert policy.path_discount(copying)[2] > 2 * policy.path_discount(fresh)[2]
