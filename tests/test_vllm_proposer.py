"""LookaheadProposer as vLLM constructs it: settings from the environment, a warm-start trie, the runner's call.

Needs vLLM importable (its version is checked): `make test` runs this file in .venv-vllm.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM runs in its own environment: `make test` runs this file there")

from lookahead.config import LookaheadConfig
from lookahead.drafting.trie import TokenTrie
from lookahead.models import pretrained_directory
from lookahead.vllm import ENVIRONMENT, Settings
from lookahead.vllm.proposer import LookaheadProposer

ANSWER = [300, 301, 302, 303, 304, 305, 306, 307]


def vllm_config(tokens: int) -> SimpleNamespace:
    directory = str(pretrained_directory())
    return SimpleNamespace(
        model_config=SimpleNamespace(model=directory, tokenizer=directory, get_vocab_size=lambda: 49152),
        speculative_config=SimpleNamespace(num_speculative_tokens=tokens),
    )


class Runner:
    """The part of vLLM's model runner the proposer reads, calling it as vLLM does."""

    def __init__(self, proposer: LookaheadProposer, prompt: list[int]) -> None:
        self.proposer, self.prompt, self.max_model_len = proposer, prompt, 2048
        ids = np.zeros((1, 64), dtype=np.int32)
        self.input_batch = SimpleNamespace(req_ids=["r"], num_tokens_no_spec=np.array([0]), token_ids_cpu=ids)
        params = SimpleNamespace(max_tokens=32, extra_args=None, ignore_eos=False, eos_token_id=2, stop_token_ids=None)
        self.requests = {"r": SimpleNamespace(prompt_token_ids=prompt, sampling_params=params)}

    def propose_draft_token_ids(self, scheduler_output: SimpleNamespace, sampled: list[int]) -> list[list[int]]:
        tokens = [*self.prompt, *sampled]
        self.input_batch.token_ids_cpu[0, : len(tokens)] = tokens
        self.input_batch.num_tokens_no_spec[0] = len(tokens)
        return self.proposer.propose([sampled], self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu)


def test_a_saved_trie_warm_starts_the_proposer(monkeypatch, tmp_path) -> None:
    path = tmp_path / "trie.bin"
    trie = TokenTrie.from_config(LookaheadConfig(), [2])
    trie.learn_answer([299, *ANSWER])
    trie.save(path)
    monkeypatch.setenv(ENVIRONMENT, Settings(LookaheadConfig(policy="fixed"), str(path)).to_json())
    proposer = LookaheadProposer(vllm_config(tokens=4))
    assert len(proposer.chains.drafting.trie) == len(trie)
    runner = Runner(proposer, prompt=[1, 2, 3])
    step = SimpleNamespace(scheduled_spec_decode_tokens={}, finished_req_ids=set(), num_scheduled_tokens={"r": 3})
    assert runner.propose_draft_token_ids(step, [299]) == [ANSWER[:4]]  # the saved answer, 4 tokens at most


def test_what_the_proposer_learned_is_saved_once_drafting_pauses(monkeypatch, tmp_path) -> None:
    """Long before `save_every_s`: vLLM may kill a worker a few seconds into its shutdown, before the last save."""
    path = tmp_path / "trie.bin"
    monkeypatch.setenv(ENVIRONMENT, Settings(trie_path=str(path), save_every_s=3600).to_json())
    proposer = LookaheadProposer(vllm_config(tokens=4))
    runner = Runner(proposer, prompt=[1, 2, 3])
    step = SimpleNamespace(scheduled_spec_decode_tokens={}, finished_req_ids=set(), num_scheduled_tokens={"r": 3})
    runner.propose_draft_token_ids(step, [299])  # the prompt's first answer token learned
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    saved = TokenTrie.load(path)
    assert saved.stats()["tokens_learned"] == proposer.chains.drafting.trie.stats()["tokens_learned"] > 0


def test_a_trie_of_another_tokenizer_is_refused(monkeypatch, tmp_path) -> None:
    path = tmp_path / "trie.bin"
    trie = TokenTrie.from_config(LookaheadConfig(), [2])
    trie.learn_answer([299, *ANSWER])
    trie.tokenizer_id = "0" * 64  # as if saved by an engine serving another model
    trie.save(path)
    monkeypatch.setenv(ENVIRONMENT, Settings(trie_path=str(path)).to_json())
    with pytest.raises(ValueError, match="built with another tokenizer"):
        LookaheadProposer(vllm_config(tokens=4))


def test_bad_settings_stop_the_proposer_with_their_reason(monkeypatch) -> None:
    monkeypatch.setenv(ENVIRONMENT, '{"config": {"policy": "greedy"}}')
    with pytest.raises(ValueError, match="policy must be 'adaptive' or 'fixed'"):
        LookaheadProposer(vllm_config(tokens=4))
