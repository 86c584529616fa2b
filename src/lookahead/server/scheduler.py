"""Continuous batching: one worker thread steps every running generation together, in arrival order.

Requests wait in a first-come-first-served queue; whenever the batch has room (at most
`max_batch` generations; a request with n choices takes n places), the next one joins at the
next step boundary, and a finished or cancelled one leaves at once. The worker hands each
text delta to the waiting request's coroutine as soon as it is accepted, so the event loop
never waits for the model. A job cancelled while it waits leaves the queue at once; one
cancelled while it runs leaves the batch before the next step.

A stopping server drains: it takes no new jobs, drops the waiting ones, and gives the running
ones a bounded time to finish before cancelling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

from ..decoding.batch import Batch
from ..decoding.generation import Generation, GenerationOutput
from ..decoding.sampling import TokenLogprob

log = logging.getLogger("lookahead.server")


class QueueFull(Exception):
    """The queue is at its limit (or closing); try again after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Stopping(QueueFull):
    """The server is stopping and takes no new jobs; `retry_after` is when its drain ends."""

    def __init__(self, retry_after: int) -> None:
        Exception.__init__(self, f"the server is stopping; retry after {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The job was cancelled (its client left, or the server is stopping)."""


class ChoiceDelta(NamedTuple):
    """New text of one choice, the tokens it came from (those not handed out before) and their draft sources."""

    index: int
    text: str
    logprobs: list[TokenLogprob] | None = None
    """The tokens' log-probabilities, when the request asked for them."""
    tokens: Sequence[int] = ()
    sources: Sequence[int] = ()
    steps: int = 0
    """The generation's forward passes after its prompt, so far."""
    closing: bool = False
    """The choice's last delta (its closing chunk): nothing of it is held back any more."""


class Job:
    """One request's generations (one per choice): the worker fills it, the request's coroutine drains it."""

    def __init__(self, scheduler: Scheduler, generations: Sequence[Generation], label: str) -> None:
        self._scheduler = scheduler
        self.generations = list(generations)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = False
        self.label = label
        self._handed_out = [0] * len(self.generations)
        """Per choice, the tokens that went out with a delta."""
        self.outputs: list[GenerationOutput] = []
        """What each choice's generation returned, once all of them ended."""
        self.outcome = "waiting"
        """waiting, running, then the finish reason ('stop', 'length'), 'cancelled' or 'error'."""
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None

    def cancel(self) -> None:
        """Leave the queue, or the batch before its next step; harmless once finished."""
        self._scheduler._cancel(self)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's text deltas as the worker produces them; raises Cancelled, or the worker's error."""
        while True:
            kind, value = await self._events.get()
            if kind == "delta":
                yield value
            elif kind == "end":
                return
            elif kind == "error":
                raise value
            else:
                raise Cancelled

    def delta(self, generation: Generation, piece: str) -> ChoiceDelta:
        """`piece` of `generation`'s text, with its tokens not yet handed out."""
        index = self.generations.index(generation)
        start, end = self._handed_out[index], len(generation.transcript.tokens)
        self._handed_out[index] = end
        chooser = generation.chooser
        logprobs = None if chooser is None or chooser.logprobs is None else chooser.chosen[start:end]
        tokens, sources = generation.transcript.tokens[start:end], generation.sources[start:end]
        return ChoiceDelta(index, piece, logprobs, tokens, sources, generation.stats.steps)

    def _push(self, kind: str, value: Any = None) -> None:
        """Thread-safe hand-over to the request's event loop (gone already if the server stopped)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))

    def _finish(self, outcome: str, kind: str | None = None, value: Any = None) -> None:
        """End the job once: a cancellation racing its last step does not end it twice."""
        with self._scheduler._cond:
            if self.finished is not None:
                return
            self.finished = time.monotonic()
        self.outcome = outcome
        self._scheduler._ended(self)  # before the client hears: it may read /metrics next
        self._push(kind or outcome, value)


class Scheduler:
    """A FIFO of jobs and one worker stepping up to `max_batch` generations together through a Batch.

    `max_waiting` jobs may wait for a place; more are refused with QueueFull.
    """

    def __init__(
        self,
        batch: Batch,
        max_waiting: int,
        on_finish: Callable[[Job], None] = lambda job: None,
    ) -> None:
        self.batch = batch
        self.max_waiting = max_waiting
        self.on_finish = on_finish
        """Called once per job as it ends, before its client is told (on the worker, or where it was cancelled)."""
        self._waiting: deque[Job] = deque()
        self._running: dict[Generation, Job] = {}
        self._leaving: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self._stopping_until: float | None = None
        """When the drain ends (monotonic time), once the server is stopping; from then on no job is taken."""
        self._service_s = 5.0  # running mean of a job's run time, for Retry-After
        self.completed = 0
        self._thread = threading.Thread(target=self._work, name="lookahead-generation", daemon=True)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Generations in the batch now."""
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def stopping(self) -> bool:
        return self._stopping_until is not None

    def start(self) -> None:
        self._thread.start()

    def submit(self, generations: Sequence[Generation], label: str) -> Job:
        """Queue one request's generations; QueueFull at the limit, Stopping once the server stops."""
        with self._cond:
            if self._stopping_until is not None:
                raise Stopping(max(1, math.ceil(self._stopping_until - time.monotonic())))
            if len(self._waiting) >= self.max_waiting:
                ahead = len(self._waiting) + 1
                raise QueueFull(max(1, math.ceil(self._service_s * ahead / self.batch.max_batch)))
            if len(generations) > self.batch.max_batch:
                raise ValueError(f"n={len(generations)} choices do not fit a batch of {self.batch.max_batch}")
            job = Job(self, generations, label)
            self._waiting.append(job)
            self._cond.notify()
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting and running ones and wait for the worker."""
        self._stop_admitting(0.0)
        with self._cond:
            self._closed = True
            self._leaving.extend(set(self._running.values()))
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    async def drain(self, timeout: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Stop: refuse new jobs, drop the waiting ones, give the running ones up to `timeout` seconds
        (less if `interrupted()` turns true), then cancel what still runs and stop the worker."""
        deadline = self._stop_admitting(timeout)
        while self._running and time.monotonic() < deadline and not interrupted():
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.close)

    def _stop_admitting(self, grace: float) -> float:
        """Refuse jobs from now on and drop the waiting ones; the end of the drain (kept if one began)."""
        with self._cond:
            if self._stopping_until is None:
                self._stopping_until = time.monotonic() + grace
            dropped = list(self._waiting)
            self._waiting.clear()
        for job in dropped:
            self._dropped(job)
        return self._stopping_until

    def _cancel(self, job: Job) -> None:
        with self._cond:
            if job.cancelled or job.finished is not None:
                return
            job.cancelled = True
            queued = job in self._waiting
            if queued:
                self._waiting.remove(job)
            else:
                self._leaving.append(job)
                self._cond.notify()
        if queued:
            self._dropped(job)

    def _dropped(self, job: Job) -> None:
        job.cancelled = True
        job._finish("cancelled")

    def _ended(self, job: Job) -> None:
        if job.started is not None:
            with self._cond:
                self.completed += 1
                self._service_s = 0.8 * self._service_s + 0.2 * (job.finished - job.started)  # type: ignore[operator]
        self.on_finish(job)

    # ---- the worker ---------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._leaving and not self._closed:
                    self._cond.wait()
                leaving, self._leaving = self._leaving, []
                for job in leaving:
                    self._remove(job)
                stop = self._closed and not self._running
                if not stop:
                    self._admit()
            for job in dict.fromkeys(leaving):
                job._finish("cancelled")
            if stop:
                return
            if self._running:
                self._step()

    def _admit(self) -> None:
        """Move waiting jobs into the batch while their choices fit (called holding the lock)."""
        while self._waiting and len(self._running) + len(self._waiting[0].generations) <= self.batch.max_batch:
            job = self._waiting.popleft()
            job.started = time.monotonic()
            job.outcome = "running"
            for generation in job.generations:
                self._running[generation] = job
                self.batch.add(generation)

    def _remove(self, job: Job) -> None:
        for generation in job.generations:
            if self._running.pop(generation, None) is not None:
                self.batch.cancel(generation)

    def _step(self) -> None:
        try:
            events = self.batch.step()
        except Exception as err:  # the whole batch shares the failed forward pass
            log.error("a decoding step failed", exc_info=err)
            with self._cond:
                failed = set(self._running.values())
                for job in failed:
                    self._remove(job)
            for job in failed:
                job._finish("error", "error", err)
            return
        ended = []
        for generation, _ in events:
            job = self._running.get(generation)
            if job is None or job.cancelled:
                continue
            if piece := generation.transcript.delta():
                job._push("delta", job.delta(generation, piece))
            if generation.done:
                with self._cond:
                    del self._running[generation]
                if all(g.done for g in job.generations):
                    ended.append(job)
        for job in dict.fromkeys(ended):  # after every choice's last delta of this step
            job.outputs = [g.output() for g in job.generations]
            job._finish(job.outputs[0].finish_reason, "end")
