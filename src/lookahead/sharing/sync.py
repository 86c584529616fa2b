"""TrieSync: one replica's side of answer sharing, off the request path.

Finished answers are queued (`share`, called as each request ends) and a background thread,
every `interval_s`, publishes them to the hub in one batch, reads the other replicas' answers
published since its last read, and learns them into the local trie. With a calibration (the
policy's acceptance rates per cell), it also posts this replica's observation totals and
counts what the others observed since the last round: a replica that learned its rates from
a quarter of the traffic drafts worse than one engine would (replayed: 3-8 % fewer tokens per
step on the worst of four replicas), one that shares them drafts as one engine does. Everything here is
best effort: a hub that is down, slow or restarted costs drafts, never an answer, so
failures are counted and logged (once per outage) and the next round tries again; what
could not be published waits in a bounded queue. A hub that refuses the tokenizer ends the
sharing for good (this replica serves alone, and says why).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ..drafting.policy import Calibration
from ..drafting.trie import TokenTrie
from .hub import Delivery, TokenizerMismatch

log = logging.getLogger("lookahead.sharing")

SYNC_INTERVAL_S = 1.0
"""Rounds a second: an answer reaches the other replicas about a second after it ends."""
MAX_PENDING = 512
"""Answers kept for publishing while the hub is unreachable; older ones are given up (speed only)."""


class Hub(Protocol):
    """What a replica asks of the hub: the AnswerHub methods, called directly or through a Ray actor."""

    def join(self, replica: str, tokenizer_id: str | None) -> tuple[str, int]: ...
    def leave(self, replica: str) -> bool: ...
    def saver(self) -> str | None: ...
    def saved(self, replica: str, position: int) -> None: ...
    def publish(self, replica: str, tokenizer_id: str | None, answers: Sequence[tuple[int, Sequence[int]]]) -> int: ...
    def since(self, replica: str, epoch: str | None, position: int) -> Delivery: ...
    def exchange_rates(
        self, replica: str, sent: Sequence[float], accepted: Sequence[float]
    ) -> tuple[list[float], list[float]]: ...
    def post_metrics(self, replica: str, text: str) -> None: ...
    def metrics(self) -> dict[str, str]: ...


class TrieSync:
    """Publishes this replica's answers and learns the others' into `trie` (see the module docstring)."""

    def __init__(
        self,
        trie: TokenTrie,
        hub: Hub,
        replica: str,
        interval_s: float = SYNC_INTERVAL_S,
        report: Callable[[], str] | None = None,
        max_pending: int = MAX_PENDING,
        calibration: Calibration | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.trie, self.hub, self.replica, self.interval_s = trie, hub, replica, interval_s
        self.report = report
        """This replica's metrics text, posted to the hub each round (the server sets it)."""
        self.calibration = calibration
        self._others_seen = (np.zeros(Calibration.CELLS), np.zeros(Calibration.CELLS))
        """The other replicas' observation totals already counted here."""
        self._pending: deque[tuple[int, list[int]]] = deque(maxlen=max_pending)
        self._serial = 0
        self._lock = threading.Lock()  # the pending queue and the read position
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lookahead-sharing", daemon=True)
        self.epoch: str | None = None
        self.position = 0
        self.published = 0
        self.applied = 0
        self.missed = 0
        self.failures = 0
        self.given_up = 0
        """Answers dropped unpublished because the queue was full (the hub was out of reach)."""
        self.refused: str | None = None
        """Why the hub refused this replica (another tokenizer); sharing is off from then on."""
        self._outage = False

    # ---- the request path ---------------------------------------------------------------

    def share(self, answers: Sequence[Sequence[int]]) -> None:
        """Queue finished answers (token ids of what was generated) for the next round; never blocks on the hub."""
        with self._lock:
            for tokens in answers:
                if tokens:
                    if len(self._pending) == self._pending.maxlen:
                        self.given_up += 1
                    self._pending.append((self._serial, list(tokens)))
                    self._serial += 1

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Join the hub (reading on from what the loaded trie file holds) and start the rounds."""
        self._call(self._join)
        self._thread.start()

    def stop(self) -> bool:
        """Last round, then leave; True if this replica is the last one live (so it saves the trie)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.sync_once()
        last = self._call(lambda: self.hub.leave(self.replica))
        return True if last is None else last  # a hub out of reach: save rather than risk losing answers

    def is_saver(self) -> bool:
        """Whether this replica keeps the periodic saves (the hub picks one; none while it is unreachable)."""
        return self._call(self.hub.saver) == self.replica

    def peer_metrics(self) -> dict[str, str]:
        """The other live replicas' latest metrics texts ({} while the hub is out of reach)."""
        texts = self._call(self.hub.metrics) or {}
        return {name: text for name, text in texts.items() if name != self.replica}

    def before_save(self) -> int:
        """Publish and learn everything now; the log position the trie is about to hold."""
        self.sync_once()
        return self.position

    def saved(self, position: int) -> None:
        self._call(lambda: self.hub.saved(self.replica, position))

    # ---- rounds -------------------------------------------------------------------------

    def sync_once(self) -> None:
        """One round: publish what is pending, learn what the others published, post the metrics."""
        if self.refused is None:
            self._call(self._round)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s) and self.refused is None:
            self.sync_once()

    def _join(self) -> None:
        self.epoch, self.position = self.hub.join(self.replica, self.trie.tokenizer_id)

    def _round(self) -> None:
        with self._lock:
            batch = list(self._pending)
        if batch:
            self.hub.publish(self.replica, self.trie.tokenizer_id, batch)
            with self._lock:  # share() may have pushed some of the batch out meanwhile: drop by number
                while self._pending and self._pending[0][0] <= batch[-1][0]:
                    self._pending.popleft()
            self.published += len(batch)
        delivery = self.hub.since(self.replica, self.epoch, self.position)
        if self.epoch is not None and delivery.epoch != self.epoch:
            log.warning("the sharing hub was restarted; reading its new log from the start")
        for tokens in delivery.answers:
            self.trie.learn_answer(tokens)
        self.applied += len(delivery.answers)
        self.missed += delivery.missed
        self.epoch, self.position = delivery.epoch, delivery.position
        if self.calibration is not None:
            self._exchange_rates(self.calibration)
        if self.report is not None:
            self.hub.post_metrics(self.replica, self.report())

    def _exchange_rates(self, calibration: Calibration) -> None:
        """Post this replica's totals; count what the others' grew by (their totals only grow, so a drop — a
        restarted hub not yet filled again — is no news, not a negative count)."""
        sent, accepted = (list(map(float, totals)) for totals in calibration.observed)
        others = [np.asarray(totals) for totals in self.hub.exchange_rates(self.replica, sent, accepted)]
        new = [np.maximum(total - seen, 0.0) for total, seen in zip(others, self._others_seen, strict=True)]
        self._others_seen = tuple(
            np.maximum(total, seen) for total, seen in zip(others, self._others_seen, strict=True)
        )
        calibration.add(*new)

    def _call(self, action: Callable[[], object]) -> object:
        """Run one exchange with the hub; a failure is counted and logged once per outage, never raised."""
        try:
            result = action()
        except TokenizerMismatch as err:
            self.refused = str(err)
            log.error("answer sharing is off for this replica: %s", err)
            return None
        except Exception as err:
            self.failures += 1
            if not self._outage:
                log.warning(
                    "the sharing hub is unreachable (%s); serving goes on, sharing resumes when it is back", err
                )
            self._outage = True
            return None
        if self._outage:
            log.info("the sharing hub is reachable again")
        self._outage = False
        return result
