"""The vLLM chain replay: recorded answers through ChainDrafting on a given step price, no vLLM."""

from __future__ import annotations

import json

import numpy as np

from lookahead.bench.chainreplay import StepPrice, main, mixed, plain_seconds, replay_chains
from lookahead.config import LookaheadConfig

EOS = 2
PROMPT = list(range(10, 40))
"""An answer that copies its prompt: the trie drafts it once the copy starts."""


def record(dataset: str, output: list[int]) -> dict:
    return {"dataset": dataset, "key": dataset, "prompt_ids": [1, *PROMPT], "output_ids": output}


def test_a_step_is_priced_by_its_rows_tokens_and_drafts() -> None:
    price = StepPrice(fixed=40.0, per_row=3.0, per_token=2.0, drafting=4.0)
    assert price(8, 8, False) == 40 + 24 + 16 and price(1, 5, True) == 40 + 3 + 10 + 4
    assert np.allclose(price.predict_widths([1, 5], rows=1), [price(1, 1, False), price(1, 5, True)])


def test_plain_decoding_reads_each_group_then_steps_while_a_row_runs() -> None:
    price = StepPrice(fixed=10.0, per_row=0.0, per_token=1.0, drafting=0.0)
    records = [record("a", [5, 6, 7]), record("b", [5])]
    prompt = len(PROMPT) + 1
    assert plain_seconds(records, 2, price) * 1000 == (10 + 2 * prompt) + 2 * (10 + 1)  # steps 1, 2: one row runs
    assert plain_seconds(records, 1, price) * 1000 == (10 + prompt) + 2 * (10 + 1) + (10 + prompt)


def test_copies_are_drafted_and_every_recorded_token_is_emitted_once() -> None:
    records = [record("a", [*PROMPT, EOS]), record("b", [*PROMPT[:20], EOS])]
    price = StepPrice()
    fixed = replay_chains(records, 1, price, frozenset([EOS]), LookaheadConfig(policy="fixed"), tokens=8)
    assert fixed.decoded == sum(len(r["output_ids"]) - 1 for r in records)  # each prompt's step emits the first
    assert fixed.steps == fixed.row_steps < fixed.decoded / 2 and fixed.accepted <= fixed.sent
    assert fixed.seconds < plain_seconds(records, 1, price)
    learned = replay_chains(records, 2, price, frozenset([EOS]), LookaheadConfig(), tokens=8, given_price=True)
    assert learned.decoded == fixed.decoded and learned.sent > 0


def test_mixed_takes_the_sets_in_turn() -> None:
    records = [record("a", [1]), record("a", [2]), record("b", [3])]
    assert [r["output_ids"] for r in mixed(records)] == [[1], [3], [2]]


def test_the_command_writes_its_table(tmp_path) -> None:
    path = tmp_path / "recording.jsonl"
    header = {
        "format": "lookahead-replay/1",
        "eos_ids": [EOS],
        "max_new_tokens": 40,
        "draft_mode": "tree",
        "cost_ms": {},
    }
    lines = [header, record("a", [*PROMPT, EOS]), record("b", [*PROMPT[:10], EOS])]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert main([str(path), "--rows", "1,2", "--out", str(tmp_path / "out")]) == 0
    results = json.loads((tmp_path / "out" / "chainreplay.json").read_text())["results"]
    assert [row["rows"] for row in results] == [1, 2] and all(row["vs_plain"] > 1 for row in results)
    assert (tmp_path / "out" / "chainreplay.md").read_text().startswith("| rows |")
