"""What is read off vLLM's model runner, against a fake runner shaped like vLLM 0.32's (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lookahead.vllm.runner import calling_runner, check_version, read_batch


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1+cpu"])
def test_the_tested_versions_are_accepted(version: str) -> None:
    check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "dev"])
def test_other_versions_are_refused_in_one_line(version: str) -> None:
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32 only \(found .*\)") as caught:
        check_version(version)
    assert "\n" not in str(caught.value)


def fake_runner() -> tuple[SimpleNamespace, SimpleNamespace]:
    """Two rows: "a" decoding (a 3-token prompt and 2 outputs, 2 drafts verified), "b" still reading its prompt."""
    ids = np.zeros((4, 16), dtype=np.int32)
    ids[0, :5] = [1, 2, 3, 4, 5]
    ids[1, :2] = [7, 8]
    plain = SimpleNamespace(max_tokens=10, extra_args=None, ignore_eos=False, eos_token_id=2, stop_token_ids=[5])
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=["a", "b"], num_tokens_no_spec=np.array([5, 2, 0, 0]), token_ids_cpu=ids),
        requests={
            "a": SimpleNamespace(prompt_token_ids=[1, 2, 3], sampling_params=plain),
            "b": SimpleNamespace(
                prompt_token_ids=[7, 8, 9, 10],
                sampling_params=SimpleNamespace(
                    max_tokens=None,
                    extra_args={"lookahead": False},
                    ignore_eos=True,
                    eos_token_id=None,
                    stop_token_ids=[],
                ),
            ),
        },
        max_model_len=40,
    )
    output = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [4, 6]}, finished_req_ids={"z"}, num_scheduled_tokens={"a": 3, "b": 2}
    )
    return runner, output


def test_read_batch_gives_each_row_its_request_and_state() -> None:
    runner, output = fake_runner()
    batch = read_batch(runner, output, [[4, 5], []])
    a, b = batch.rows
    assert (a.request, list(a.prompt), list(a.tail), a.length, list(a.sampled)) == (
        "a",
        [1, 2, 3],
        [1, 2, 3, 4, 5],
        5,
        [4, 5],
    )
    assert a.verified == 2 and a.room == 8 and a.drafting  # 10 tokens at most, 2 emitted
    assert (b.request, list(b.sampled), b.verified) == ("b", [], 0)
    assert b.room == 38 and not b.drafting  # no max_tokens: the context window's room; drafting turned off
    assert a.stops == {2, 5} and b.stops == set()  # EOS and stop ids end a request, unless EOS is ignored
    assert list(batch.finished) == ["z"] and batch.carried == {"a": 3, "b": 2} and set(batch.live) == {"a", "b"}


def test_the_proposer_must_be_called_by_the_runner() -> None:
    runner, output = fake_runner()

    class Runner:
        input_batch = runner.input_batch

        def propose_draft_token_ids(self, scheduler_output: object) -> tuple:
            return proposer_propose()

    def proposer_propose() -> tuple:
        return calling_runner()

    found, scheduled = Runner().propose_draft_token_ids(output)
    assert isinstance(found, Runner) and scheduled is output
    with pytest.raises(RuntimeError, match="must be called by vLLM's model runner"):
        proposer_propose()
