"""First come, first served: one worker thread runs one generation at a time, in arrival order.

The engine's lock keeps forward passes apart but is not fair, and on a CPU two generations at
once only slow each other down; this queue is fair and keeps the event loop free. The worker
hands each text delta to the waiting request's coroutine as soon as it is accepted. A job
cancelled while it waits leaves the queue at once; one cancelled while it runs is stopped at
its next delta (its stream is closed, which ends the generation and frees the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any


class QueueFull(Exception):
    """The queue is at its limit (or closing); try again after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class Cancelled(Exception):
    """The job was cancelled (its client left, or the server is stopping)."""


class Job:
    """One request's generation: the worker fills it, the request's coroutine drains it."""

    def __init__(self, scheduler: Scheduler, start: Callable[[], Iterable[str]], label: str) -> None:
        self._scheduler = scheduler
        self._start = start
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._stop = threading.Event()
        self.label = label
        self.output: Any = None
        """What the stream reports once exhausted (the engine's GenerationOutput)."""
        self.outcome = "waiting"
        """waiting, running, then the finish reason ('stop', 'length'), 'cancelled' or 'error'."""
        self.submitted = time.monotonic()
        self.started: float | None = None
        self.finished: float | None = None

    def cancel(self) -> None:
        """Leave the queue, or stop generating at the next delta; harmless once finished."""
        self._scheduler._cancel(self)

    async def deltas(self) -> AsyncIterator[str]:
        """Text deltas as the worker produces them; raises Cancelled, or the worker's error."""
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

    def _push(self, kind: str, value: Any = None) -> None:
        """Thread-safe hand-over to the request's event loop (gone already if the server stopped)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))

    def _run(self) -> None:
        """The worker's side: drive the stream until it ends or the job is cancelled."""
        self.started = time.monotonic()
        self.outcome = "running"
        if self._stop.is_set():  # cancelled between leaving the queue and starting
            self._finish("cancelled")
            return
        try:
            stream = self._start()
            try:
                for delta in stream:
                    if self._stop.is_set():
                        break
                    self._push("delta", delta)
            finally:
                getattr(stream, "close", lambda: None)()  # ends the generation if it was cut short
            if self._stop.is_set():
                self._finish("cancelled")
            else:
                self.output = stream.output  # type: ignore[attr-defined]
                self._finish(self.output.finish_reason, "end")
        except Exception as err:
            self._finish("error", "error", err)

    def _finish(self, outcome: str, kind: str | None = None, value: Any = None) -> None:
        self.outcome = outcome
        self.finished = time.monotonic()
        self._scheduler._ended(self)  # before the client hears: it may read /metrics next
        self._push(kind or outcome, value)


class Scheduler:
    """A FIFO of jobs with one worker; `max_waiting` jobs may wait behind the running one."""

    def __init__(self, max_waiting: int, on_finish: Callable[[Job], None] = lambda job: None) -> None:
        self.max_waiting = max_waiting
        self.on_finish = on_finish
        """Called once per job as it ends, before its client is told (on the worker, or where it was cancelled)."""
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._service_s = 5.0  # running mean of a job's run time, for Retry-After
        self.completed = 0
        self._thread = threading.Thread(target=self._work, name="lookahead-generation", daemon=True)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def start(self) -> None:
        self._thread.start()

    def submit(self, start: Callable[[], Iterable[str]], label: str) -> Job:
        """Queue `start` (called on the worker, returning the stream of deltas); QueueFull at the limit."""
        with self._cond:
            if self._closed or len(self._waiting) >= self.max_waiting:
                raise QueueFull(max(1, math.ceil(self._service_s * (len(self._waiting) + 1))))
            job = Job(self, start, label)
            self._waiting.append(job)
            self._cond.notify()
        return job

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new jobs, cancel the waiting ones, stop the running one and wait for the worker."""
        with self._cond:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            if self._running is not None:
                self._running._stop.set()
            self._cond.notify_all()
        for job in dropped:
            self._dropped(job)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            queued = job in self._waiting
            if queued:
                self._waiting.remove(job)
            job._stop.set()
        if queued:
            self._dropped(job)

    def _dropped(self, job: Job) -> None:
        job._stop.set()
        job._finish("cancelled")

    def _ended(self, job: Job) -> None:
        if job.started is not None:
            with self._cond:
                self.completed += 1
                self._service_s = 0.8 * self._service_s + 0.2 * (job.finished - job.started)  # type: ignore[operator]
        self.on_finish(job)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._running = self._waiting.popleft()
            job._run()
            with self._cond:
                self._running = None
