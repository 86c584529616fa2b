"""Replay must predict exactly what a real run does: same steps, same tokens per step."""

import json

import numpy as np
import pytest

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.bench.datasets import load_prompts
from lookahead.bench.replay import (
    ReplayStats,
    load_records,
    oracle_choices,
    record,
    recorded_cost,
    replay,
    replay_record,
)
from lookahead.cli import main
from lookahead.decoding.step import Priced
from lookahead.drafting.drafter import TrieDrafting
from lookahead.drafting.tree import DraftTree


def test_oracle_follows_the_recording_only_along_matching_paths():
    # root; 1: 7 (matches), 2: 9 (does not), 3: 8 under 1 (matches)
    tree = DraftTree(tokens=[7, 9, 8], parents=[0, 0, 1])
    output = [5, 7, 8, 6]
    assert oracle_choices(tree, output, pos=1) == [7, 8, -1, 6]


def test_replay_prices_every_step_at_its_context():
    header = {"eos_ids": [0], "max_new_tokens": 20, "draft_mode": "tree", "cost_ms": {"1": 10.0, "64": 20.0},
              "cost_by_context": {"4096": {"1": 30.0, "64": 60.0}}}  # fmt: skip
    prompt = [1 + i % 1000 for i in range(2000)]
    record = {"dataset": "d", "key": "k", "prompt_ids": prompt, "output_ids": [2001 + i for i in range(20)]}
    config = LookaheadConfig(policy="fixed")
    stats = ReplayStats()
    replay_record(TrieDrafting.from_config(config, [0]), header, record, stats)
    assert stats.steps == 19, "nothing to draft: plain steps after the first token"
    at_2000 = 10.0 + 20.0 * (2000 - 128) / (4096 - 128)  # one row of 1, linear between 128 and 4096 tokens
    assert stats.priced_ms == pytest.approx(19 * at_2000, rel=0.01), "not the 10 ms of a 128-token context"
    assert stats.plain_ms == pytest.approx(stats.priced_ms)


def test_bad_recording_file(tmp_path):
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"something": "else"}\n')
    with pytest.raises(ValueError, match="not a replay recording"):
        load_records(bad)
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2


TOKENS = 24  # a few steps of drafting and accepting a prompt, for both the real run and its replay


class PricedAsRecorded(Priced):
    """A real run priced as its replay is, whose verdicts tell the drafter only what a recording of plain decoding
    knows: the model's likeliest tokens along the kept path, none after the nodes turned down."""

    def verify(self, generations, trees):
        verdicts, milliseconds = super().verify(generations, trees)
        told = []
        for verdict, tree in zip(verdicts, trees, strict=True):
            rows, path = verdict.following, [0, *verdict.accepted]
            # the real verifier's rows: one per verified position; the kept path's start with the emitted tokens
            if rows is not None:
                assert rows.shape == (len(tree) + 1, 8) and (rows >= 0).all()
                assert rows[path, 0].tolist() == verdict.emitted
                rows = np.where(np.isin(np.arange(len(rows)), path)[:, None], rows, -1)
            told.append(verdict._replace(following=rows))
        return told, milliseconds


@pytest.fixture(scope="module")
def recording(default_model, tmp_path_factory):
    model, tokenizer = default_model
    prompts = load_prompts(["code-edit", "gsm8k"], 2)
    path = tmp_path_factory.mktemp("replay") / "rec.jsonl"
    record(LookaheadEngine(model, tokenizer, LookaheadConfig(recycled=8)), prompts, TOKENS, path)
    return prompts, path


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        LookaheadConfig(decoding_length=12, branch_length=6, policy="fixed"),
        LookaheadConfig(),
        LookaheadConfig(recycled=8),
    ],
    ids=["fixed", "adaptive", "adaptive-recycled"],
)
def test_replay_equals_a_real_run(default_model, recording, config):
    model, tokenizer = default_model
    prompts, path = recording
    header, records = load_records(path)
    assert header["cost_ms"]["1"] > 0 and len(records) == 4
    for rec in records:  # the model's likeliest tokens at every step, for recycled drafts to replay from
        assert len(rec["following"]) == len(rec["output_ids"]) - 1
        assert all(row[0] == token for row, token in zip(rec["following"], rec["output_ids"][1:], strict=True))
    real = LookaheadEngine(model, tokenizer, config)  # a fresh trie, like the replay's
    if real.policy.adaptive:  # the policy reacts to step times: give it the replay's curves and prices
        real.policy.cost = recorded_cost(header)
        real.verifier = PricedAsRecorded(real.verifier, recorded_cost(header))
    steps: dict[str, int] = {}
    drafted: dict[str, int] = {}
    for prompt, rec in zip(prompts, records, strict=True):
        out = real.generate(rec["prompt_ids"], max_new_tokens=TOKENS)
        assert out.token_ids == rec["output_ids"]
        steps[prompt.dataset] = steps.get(prompt.dataset, 0) + out.stats.steps
        drafted[prompt.dataset] = drafted.get(prompt.dataset, 0) + out.stats.draft_tokens
    replayed = replay(records, header, config)
    assert {name: stats.steps for name, stats in replayed.items()} == steps
    assert {name: stats.draft_tokens for name, stats in replayed.items()} == drafted
    assert sum(drafted.values()) > 0
    assert json.loads(path.read_text().splitlines()[0])["format"] == "lookahead-replay/1"
