"""The server's queue and batch on their own: arrival order, a place per choice, cancellation while waiting
or running, a full queue that says when to retry, the drain of a stopping server. A tiny random model keeps it
fast; the engine is real."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import hf_greedy
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.server.scheduler import Cancelled, QueueFull, Scheduler, Stopping

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


def _gated(engine, gate, length: int = 400):
    """A generation whose worker waits at its first step until `gate` is set: it is surely running then."""
    return engine.prepare([5, 6, 7], length, on_tokens=lambda tokens: gate.wait(30))


async def _outcome(job) -> str:
    try:
        async for _ in job.deltas():
            pass
    except Cancelled:
        return "cancelled"
    return job.outputs[0].finish_reason


@pytest.mark.parametrize("timeout", [60.0, 0.0], ids=["running job finishes", "drain time over"])
def test_drain_refuses_new_jobs_drops_waiting_ones_and_bounds_running_ones(engine, timeout):
    gate = threading.Event()

    async def main() -> tuple[str, str, int]:
        scheduler = Scheduler(engine.batch(1), max_waiting=4)
        running = scheduler.submit([_gated(engine, gate)], "test")
        waiting = scheduler.submit([engine.prepare([5, 6, 8], 8)], "test")
        scheduler.start()
        while running.started is None:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(scheduler.drain(timeout))
        await asyncio.sleep(0.05)
        assert scheduler.stopping and running.finished is None
        with pytest.raises(Stopping) as refused:
            scheduler.submit([engine.prepare([5, 6], 4)], "test")
        gate.set()
        outcomes = await _outcome(running), await _outcome(waiting)
        await asyncio.wait_for(drain, 30)
        return *outcomes, refused.value.retry_after

    ran, waited, retry_after = asyncio.run(main())
    assert waited == "cancelled"
    assert ran == ("length" if timeout else "cancelled")
    assert retry_after >= 1


def test_drain_ends_running_jobs_at_once_when_interrupted(engine):
    gate = threading.Event()

    async def main() -> str:
        scheduler = Scheduler(engine.batch(1), max_waiting=4)
        running = scheduler.submit([_gated(engine, gate)], "test")
        scheduler.start()
        while running.started is None:
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.wait_for(scheduler.drain(60, interrupted=lambda: True), 30)
        return await _outcome(running)

    assert asyncio.run(main()) == "cancelled"
