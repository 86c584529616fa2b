"""The server's queue on its own: first come first served, a waiting job cancelled leaves at once,
a full queue says when to retry. A tiny random model keeps it fast; the engine is real."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import tiny_model

from lookahead import LookaheadConfig, LookaheadEngine
from lookahead.server.scheduler import Cancelled, QueueFull, Scheduler


@pytest.fixture(scope="module")
def engine():
    return LookaheadEngine(tiny_model("llama"), None, LookaheadConfig(policy="fixed"))


def run_jobs(engine, count: int, cancel: set[int] = frozenset()) -> tuple[list[int], list[str], list]:
    """Submit `count` generations at once, cancel some while they wait; start order, outcomes, outputs."""
    started: list[int] = []
    finished = []
    scheduler = Scheduler(max_waiting=count, on_finish=finished.append)

    def starter(number: int):
        def start():
            started.append(number)
            return engine.stream([5, 6, 7, number + 10], max_new_tokens=24)

        return start

    async def main() -> list:
        jobs = [scheduler.submit(starter(i), "test") for i in range(count)]
        for i in cancel:
            jobs[i].cancel()
        scheduler.start()
        results = []
        for job in jobs:
            try:
                async for _ in job.deltas():
                    pass
                results.append(job.output)
            except Cancelled:
                results.append(None)
        await asyncio.to_thread(scheduler.close)
        return results

    results = asyncio.run(main())
    return started, [job.outcome for job in finished], results


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


def test_full_queue_refuses_with_a_retry_time():
    async def main() -> int:
        scheduler = Scheduler(max_waiting=2)  # not started: nothing leaves the queue
        for _ in range(2):
            scheduler.submit(lambda: iter(()), "test")
        with pytest.raises(QueueFull) as full:
            scheduler.submit(lambda: iter(()), "test")
        scheduler.close()
        return full.value.retry_after

    assert asyncio.run(main()) >= 1
