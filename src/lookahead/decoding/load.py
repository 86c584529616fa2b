"""How busy the rest of the machine is: the share of its CPU time that other processes took over an interval.

Timings are only as good as the moment they were taken: a pass timed while a build or an
install runs beside it can cost twice its quiet price. Other tenants only ever slow a pass,
so a measurement is trusted when the rest of the machine was quiet while it ran
(decoding/costs.py). Busy time counts other processes and a hypervisor's steal, not our own
threads.
"""

from __future__ import annotations

import time

import psutil

QUIET = 0.15
"""Most share of the machine's CPU time others may take while a measurement is trusted."""


def _busy_seconds() -> float:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    guests = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)  # already counted in user and nice
    return sum(times) - idle - guests


class OthersLoad:
    """The share of the machine's CPU time taken by other processes since `restart()` (or creation)."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        self.restart()

    def restart(self) -> None:
        self._wall = time.perf_counter()
        self._busy = _busy_seconds()
        self._own = self._own_seconds()

    def _own_seconds(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def share(self) -> float:
        """Others' busy time over the machine's capacity since the start: 0 quiet, 1 every core taken."""
        wall = time.perf_counter() - self._wall
        if wall <= 0:
            return 0.0
        others = (_busy_seconds() - self._busy) - (self._own_seconds() - self._own)
        return min(max(others / (wall * self._cores), 0.0), 1.0)

    def quiet(self) -> bool:
        return self.share() <= QUIET
