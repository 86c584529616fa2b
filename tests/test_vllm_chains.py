"""ChainDrafting, the vLLM proposer's core, driven as vLLM's runner drives it: rows of a fake batch, step by step."""

from __future__ import annotations

import pytest

from lookahead.config import LookaheadConfig
from lookahead.drafting.drafter import TrieDrafter, TrieDrafting
from lookahead.vllm.chains import Batch, ChainDrafting, Row, TokensCost

EOS = 2
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
"""A prompt the answer below copies from: the trie drafts the rest of it once the copy starts."""


class Clock:
    """A stub clock the test advances: what a step costs is the test's choice, no timing on a shared machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_chains(policy: str = "fixed", max_tokens: int = 8, clock: Clock | None = None) -> ChainDrafting:
    config = LookaheadConfig(policy=policy)
    return ChainDrafting(TrieDrafting.from_config(config, [EOS]), max_tokens, clock or Clock())


class Request:
    """One request as vLLM's runner would report it: its tokens so far, and what the last step sampled."""

    def __init__(self, name: str, prompt: list[int], max_tokens: int = 64) -> None:
        self.name, self.prompt, self.max_tokens = name, prompt, max_tokens
        self.tokens = list(prompt)
        self.sampled: list[int] = []
        self.verified = 0

    def step(self, sampled: list[int], verified: int = 0) -> Row:
        self.tokens += sampled
        self.sampled, self.verified = sampled, verified
        return self.row()

    def row(self) -> Row:
        room = self.max_tokens - (len(self.tokens) - len(self.prompt))
        tail, length = self.tokens[-256:], len(self.tokens)
        return Row(self.name, self.prompt, tail, length, self.sampled, self.verified, room, stops=frozenset([EOS]))


def test_a_joining_request_is_drafted_from_its_prompt() -> None:
    chains = make_chains()
    request = Request("a", PROMPT)
    assert chains.propose(Batch([request.row()])) == [[]]  # its prompt is still being read: nothing sampled yet
    assert chains.open_requests == 1
    drafts = chains.propose(Batch([request.step([12])]))  # the prefill's token: "12" is followed by 13, 14, ...
    assert drafts == [[13, 14, 15, 16, 17, 18, 19, 20]]  # at most max_tokens


@pytest.fixture
def heard(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """What each drafter is told by `verified`: (the chain the step carried, the accepted block indices)."""
    calls: list[tuple[list[int], list[int]]] = []
    verified = TrieDrafter.verified

    def spy(self: TrieDrafter, tree, accepted, following=None) -> None:
        calls.append((list(tree.tokens), list(accepted)))
        verified(self, tree, accepted, following)

    monkeypatch.setattr(TrieDrafter, "verified", spy)
    return calls


def test_accepted_counts_reach_the_drafter(heard: list) -> None:
    chains = make_chains(max_tokens=4)
    request = Request("a", PROMPT)
    chains.propose(Batch([request.step([12])]))
    chains.propose(Batch([request.step([13, 14, 99], verified=4)]))
    assert heard[-1] == ([13, 14, 15, 16], [1, 2])  # two accepted, the third rejected (the model said 99)
    chains.propose(Batch([request.step([5], verified=0)]))
    assert heard[-1] == ([], [])  # nothing was carried: an empty chain was verified


def test_trimmed_drafts_count_only_what_the_step_carried(heard: list) -> None:
    chains = make_chains(max_tokens=4)
    request = Request("a", PROMPT)
    assert chains.propose(Batch([request.step([12])])) == [[13, 14, 15, 16]]
    chains.propose(Batch([request.step([13, 14], verified=1)]))  # vLLM carried one draft of four
    assert heard[-1] == ([13], [1])


def test_the_room_limits_the_chain() -> None:
    chains = make_chains()
    request = Request("a", PROMPT, max_tokens=4)
    assert chains.propose(Batch([request.step([12])])) == [[13, 14]]  # 3 tokens may still come: 2 drafts + 1
    assert chains.propose(Batch([request.step([13, 14, 15], verified=2)])) == [[]]  # one token left: no draft


def test_finished_requests_are_closed_and_nothing_leaks() -> None:
    chains = make_chains()
    for turn in range(50):
        requests = [Request(f"{turn}-{i}", [*PROMPT, i]) for i in range(4)]
        chains.propose(Batch([r.step([12]) for r in requests]))
        chains.propose(Batch([r.step([13]) for r in requests]))
        chains.propose(Batch([], finished=[r.name for r in requests]))
    assert chains.open_requests == 0
    assert chains.closed == 200
    assert chains.drafting.trie.stats()["live_requests"] == 0  # no prompt index is left behind
    chains.close("never-seen")  # an unknown id (a request that never drafted) is ignored


def test_a_second_request_is_drafted_from_the_first_ones_answer() -> None:
    chains = make_chains()
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, EOS]
    first = Request("first", [7, 8, 9])
    chains.propose(Batch([first.step([answer[0]])]))
    for token in answer[1:]:
        chains.propose(Batch([first.step([token])]))
    chains.propose(Batch([], finished=["first"]))
    second = Request("second", [7, 8, 9])
    assert chains.propose(Batch([second.step([answer[0]])])) == [answer[1:9]]


def test_requests_vllm_no_longer_holds_are_closed_without_a_finished_call() -> None:
    chains = make_chains()
    first, second = Request("a", PROMPT), Request("b", PROMPT)
    chains.propose(Batch([first.step([12]), second.step([12])], live={"a", "b"}))
    chains.propose(Batch([second.step([13])], live={"b"}))  # "a" ended in a step vLLM did not call us after
    assert chains.open_requests == 1 and chains.closed == 1


def test_a_step_vllm_ran_without_us_is_learned_and_not_priced() -> None:
    clock = Clock()
    chains = make_chains("adaptive", clock=clock)
    request = Request("a", [7, 8, 9], max_tokens=100)
    chains.propose(Batch([request.step([40])], carried={"a": 3}))
    clock.now += 0.01
    chains.propose(Batch([request.step([41])], carried={"a": 1}))
    request.tokens.append(42)  # a step vLLM ran without calling the proposer (a row near the context limit)
    clock.now += 0.05
    chains.propose(Batch([request.step([43])], carried={"a": 1}))
    assert chains.steady_steps == 1  # the two-step interval was not priced as one step
    chains.propose(Batch([], finished=["a"]))
    drafter = chains.drafting.open([7, 8, 9])  # what a new request on the same prompt is offered, before pricing
    try:
        assert list(drafter.propose([7, 8, 9, 40], 100, branching=False).tokens[:3]) == [41, 42, 43]  # 42 learned
    finally:
        drafter.close()


def test_tokens_past_a_stop_are_not_learned() -> None:
    chains = make_chains()
    first = Request("first", [7, 8, 9])
    chains.propose(Batch([first.step([40])]))
    chains.propose(Batch([first.step([41, EOS, 77, 78])]))  # vLLM cuts the output at EOS; the trie must too
    chains.propose(Batch([], finished=["first"]))
    second = Request("second", [7, 8, 9])
    assert chains.propose(Batch([second.step([40])])) == [[41, EOS]]


def run_steady(chains: ChainDrafting, clock: Clock, price: dict[int, float], steps: int) -> list[int]:
    """Steps of 4 rows copying their prompts, each step taking `price[tokens it carried per row, rounded up]` ms."""
    requests = [Request(f"r{i}", [*PROMPT, *PROMPT], max_tokens=10_000) for i in range(4)]
    drafts = chains.propose(Batch([r.step([12]) for r in requests]))
    sent = []
    for _ in range(steps):
        carried = {r.name: 1 + len(d) for r, d in zip(requests, drafts, strict=True)}
        width = -(-sum(carried.values()) // len(carried))
        clock.now += price.get(width, price[max(price)]) / 1000
        rows = []
        for r, d in zip(requests, drafts, strict=True):
            nxt = r.tokens[-1] + 1 if r.tokens[-1] < 21 else 10
            accepted = []
            for token in d:
                if token != nxt:
                    break
                accepted.append(token)
                nxt = nxt + 1 if nxt < 21 else 10
            rows.append(r.step([*accepted, nxt], verified=len(d)))
        drafts = chains.propose(Batch(rows, carried=carried))
        sent.append(sum(map(len, drafts)))
    return sent


def test_the_policy_sends_nothing_where_drafting_does_not_pay() -> None:
    clock = Clock()
    chains = make_chains("adaptive", clock=clock)
    sent = run_steady(chains, clock, {1: 10.0, 2: 200.0}, steps=120)  # any draft costs 20 plain steps
    assert chains.steady_steps > 110
    drafting = [tokens for tokens in sent[10:] if tokens]  # after trying each width once: plain steps,
    assert len(drafting) <= 0.05 * len(sent[10:])  # but for a rare retry of a price seen long ago


def test_the_policy_sends_chains_where_drafting_pays() -> None:
    clock = Clock()
    chains = make_chains("adaptive", clock=clock)
    sent = run_steady(chains, clock, {1: 10.0, 16: 11.0}, steps=60)  # drafts nearly free; the copies are right
    assert min(sent[-10:]) >= 4 * 4


def test_retrieval_reaches_no_deeper_than_vllm_takes_and_stops_at_the_floors(monkeypatch) -> None:
    chains = make_chains("adaptive", max_tokens=4)
    chains.drafting.policy.cost = TokensCost(1, 10.0)
    calls = []
    retrieve = chains.drafting.trie.retrieve
    monkeypatch.setattr(chains.drafting.trie, "retrieve", lambda *a, **k: calls.append((a, k)) or retrieve(*a, **k))
    alone, other = Request("a", PROMPT), Request("b", PROMPT)
    chains.propose(Batch([alone.row()]))
    chains.propose(Batch([alone.step([12])]))
    chains.propose(Batch([alone.step([13]), other.step([12])]))
    assert [k["floors"] is not None for _, k in calls] == [True, False, False]
    assert [a[2] for a, _ in calls] == [4, 4, 4]  # as deep as the chain vLLM takes, not the trie's 32
    least = chains.drafting.least(2, len(alone.tokens) - 1)
    assert least is not None and least[0] > 0, "rows together: each stops under the least chance the step could send"
    assert [k["min_score"] for _, k in calls] == [0.0, *least]


def test_steps_that_read_a_prompt_are_not_priced() -> None:
    clock = Clock()
    chains = make_chains("adaptive", clock=clock)
    first, joining = Request("a", PROMPT), Request("b", PROMPT)
    chains.propose(Batch([first.step([12])]))
    clock.now += 5.0  # a long prefill of b ran in this step
    chains.propose(Batch([first.step([13]), joining.row()], carried={"a": 1, "b": 500}))
    assert chains.steady_steps == 0 and chains.drafting.policy.cost is None


def test_the_price_of_a_token_is_learned_from_steps_of_several_sizes() -> None:
    cost = TokensCost(tokens=4, milliseconds=40.0)  # the first plain step of 4 rows
    for tokens in [4, 16, 8, 12, 4, 16] * 20:
        cost.observe(tokens / 2, 20.0 + 5.0 * tokens, rows=2)  # really 20 ms + 5 ms a token
    assert cost.per_token == pytest.approx(5.0, rel=0.05) and cost.fixed == pytest.approx(20.0, rel=0.1)
    assert cost.predict(4.0, rows=4) == cost.predict(8.0, rows=2) == cost.predict(16.0)  # tokens in all price it


def test_until_steps_spread_over_sizes_a_token_keeps_its_cautious_price() -> None:
    cost = TokensCost(tokens=16, milliseconds=64.0)
    assert cost.per_token == 2.0 and cost.predict(1.0, rows=16) == 64.0  # half the first step's price per token
    for _ in range(1000):
        cost.observe(1.0, 80.0, rows=16)  # only plain steps of 16 rows, dearer now: nothing shows a token's price
    assert cost.per_token == pytest.approx(2.0, rel=0.05) and cost.predict(1.0, rows=16) == pytest.approx(80.0)


def test_a_pause_is_not_taken_for_a_price_but_a_lasting_change_is() -> None:
    cost = TokensCost(tokens=1, milliseconds=10.0)
    for tokens in [1, 5, 9] * 10:
        cost.observe(tokens, 10.0 + tokens)
    before, price = (cost.fixed, cost.per_token), cost.predict(5)
    cost.observe(5, 500.0)  # a pause of half a second in one step
    assert (cost.fixed, cost.per_token) == before
    for _ in range(2):
        cost.observe(5, 500.0)  # three in a row: the machine is that slow now
    assert cost.predict(5) > 1.5 * price


def test_early_steps_far_off_the_first_price_are_evidence() -> None:
    cost = TokensCost(tokens=1, milliseconds=10.0)
    cost.observe(1, 10.0)  # the first timed step
    cost.observe(16, 200.0)  # a first drafted step 10x its price: the start was a guess, not a pause
    assert cost.per_token > 10 * cost.prior_per_token


def test_a_fit_through_the_origin_keeps_its_slope() -> None:
    cost = TokensCost(tokens=1, milliseconds=1.0)
    for tokens in [2, 4, 8] * 100:
        cost.observe(tokens, 3.0 * tokens - 2.0)  # a line that would cross zero above one token
    assert cost.fixed == 0.0 and cost.predict(8) == pytest.approx(22.0, rel=0.1)


def test_the_first_timed_plain_step_prices_the_steps() -> None:
    clock = Clock()
    chains = make_chains("adaptive", clock=clock)
    requests = [Request(f"r{i}", PROMPT) for i in range(3)]
    chains.propose(Batch([r.step([12]) for r in requests]))
    clock.now += 0.030
    chains.propose(Batch([r.step([13]) for r in requests], carried={r.name: 1 for r in requests}))
    assert chains.drafting.policy.cost.predict(1.0, rows=3) == pytest.approx(30.0)
