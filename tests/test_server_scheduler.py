"""The server's queue and batch on their own: arrival order, a place per choice, cancellation while waiting
or running, a full queue that says when to retry. A tiny random model keeps it fast; the engine is real."""

from __future__ import annotations

import asyncio

import pytest
from conftest import hf_greedy
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.server.scheduler import Cancelled, QueueFull, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # every generation runs to its length
    return LookaheadEngine(model, None, LookaheadConfig(policy="fixed"))


def run_jobs(engine, count: int, cancel: set[int] = frozenset(), max_batch: int = 1, cancel_running: int | None = None):
    """Submit `count` one-choice generations at once, cancel some while they wait; start order, outcomes, outputs."""
    finished = []

    async def main() -> list:
        scheduler = Scheduler(engine.batch(max_batch), max_waiting=count, on_finish=finished.append)
        jobs: list = []

        def cancel_after_two_steps(number: int):
            calls = []  # called on the worker with each step's tokens: the job is cut mid-generation, always
            return lambda tokens: calls.append(tokens) or (len(calls) == 2 and jobs[number].cancel())

        for i in range(count):
            hook = cancel_after_two_steps(i) if i == cancel_running else None
            jobs.append(scheduler.submit([engine.prepare([5, 6, 7, i + 10], 24, on_tokens=hook)], "test"))
        for i in cancel:
            jobs[i].cancel()
        scheduler.start()
        results = []
        for job in jobs:
            try:
                async for _ in job.deltas():
                    pass
                results.append(job.outputs[0])
            except Cancelled:
                results.append(None)
        await asyncio.to_thread(scheduler.close)
        return jobs, results

    jobs, results = asyncio.run(main())
    order = sorted(range(count), key=lambda i: (jobs[i].started is None, jobs[i].started or 0))
    return [i for i in order if jobs[i].started is not None], [job.outcome for job in finished], results


def test_jobs_run_in_arrival_order(engine):
    started, outcomes, results = run_jobs(engine, 6)
    assert started == list(range(6))
    assert outcomes == ["length"] * 6
    for number, output in enumerate(results):
        assert output.token_ids == engine.generate([5, 6, 7, number + 10], 24).token_ids


def test_a_job_cancelled_while_waiting_never_runs(engine):
    started, outcomes, results = run_jobs(engine, 4, cancel={1, 2})
    assert started == [0, 3]
    assert sorted(outcomes) == ["cancelled", "cancelled", "length", "length"]
    assert results[1] is None and results[2] is None and results[3].token_ids


def test_jobs_share_the_batch_and_each_equals_its_request_alone(engine):
    started, outcomes, results = run_jobs(engine, 6, max_batch=4)
    assert started == list(range(6)) and outcomes.count("length") == 6
    for number, output in enumerate(results):
        assert output.token_ids == hf_greedy(engine.model, [5, 6, 7, number + 10], 24)


def test_a_job_cancelled_while_running_leaves_and_the_rest_finish(engine):
    _, outcomes, results = run_jobs(engine, 3, max_batch=3, cancel_running=0)
    assert sorted(outcomes) == ["cancelled", "length", "length"]
    assert results[0] is None and results[2].token_ids == hf_greedy(engine.model, [5, 6, 7, 12], 24)


def test_full_queue_refuses_with_a_retry_time(engine):
    async def main() -> int:
        scheduler = Scheduler(engine.batch(2), max_waiting=2)  # not started: nothing leaves the queue
        for _ in range(2):
            scheduler.submit([engine.prepare([5, 6], 4)], "test")
        with pytest.raises(QueueFull) as full:
            scheduler.submit([engine.prepare([5, 6], 4)], "test")
        scheduler.close()
        return full.value.retry_after

    assert asyncio.run(main()) >= 1
