"""AnswerHub: the log through which replicas share the answers they finished, so every trie learns all traffic.

Plain Python (no Ray, no torch): a Ray actor wraps it unchanged, and the replay benchmark
and the tests use it directly. What it keeps:

- a bounded log of answers (token ids only: prompts belong to their request and are never
  shared), each at a position; a reader asks for everything after the position it last saw
  and gets the others' answers, never its own. When the log is over its bounds the oldest
  answers go; a reader that had not read them is told how many it missed (costs speed only:
  verification is lossless whatever a trie holds).
- exactly-once delivery: a replica (named anew each time one starts) numbers its answers,
  and a retried publish (the reply was lost, the batch is sent again) adds nothing. Equal
  answers from two replicas are both kept, as one engine serving both would count them twice.
- one tokenizer: token ids of another vocabulary would mean other words, so a replica whose
  tokenizer differs from the first one's is refused.
- members: who joined, who was heard from lately, who saves the trie file (the longest
  joined live member, so periodic saves are not written by every replica), and the position
  the last save covered, which a restarted replica starts reading from after loading it.
- each member's calibration: its running totals of draft nodes sent and accepted per cell
  (the policy's acceptance rates), posted every round; a reader gets the others' sums and
  learns what grew since it last read. Totals only grow, so a repost is harmless and a
  restarted hub is filled again by the next round.
- each member's latest metrics text, so one scrape of any replica sees them all.

`epoch` names this log: a hub that was restarted (its actor died and Ray made a new one)
starts empty under a new epoch, and readers from the old one start over at its beginning.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

MAX_ANSWERS = 4096
"""Answers kept in the log: a replica that is minutes behind still finds what it missed."""
MAX_TOKENS = 4_000_000
"""Tokens kept in the log (16 MB as Python ints would be far more; as lists about 32 MB at most)."""
MEMBER_TIMEOUT_S = 30.0
"""A member not heard from for this long is taken for gone (it syncs every second or so)."""


class TokenizerMismatch(ValueError):
    """The replica's tokenizer is not the one this hub's answers are in."""


@dataclass(frozen=True)
class Delivery:
    """What a reader gets: the others' answers after its position, where to read from next, what it missed."""

    epoch: str
    answers: list[list[int]]
    position: int
    missed: int = 0


@dataclass
class _Member:
    joined: int
    heard: float
    serial: int = -1
    """The highest answer number accepted from this member: lower or equal ones are retries."""
    metrics: str = ""


@dataclass
class AnswerHub:
    """The shared answer log of one deployment's replicas (see the module docstring)."""

    max_answers: int = MAX_ANSWERS
    max_tokens: int = MAX_TOKENS
    member_timeout_s: float = MEMBER_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    tokenizer_id: str | None = None
    saved_through: int = 0
    """Log position the last trie save covered: a replica loading that file reads on from here."""

    def __post_init__(self) -> None:
        if self.max_answers < 1 or self.max_tokens < 1:
            raise ValueError("the hub must keep at least one answer and one token")
        self._log: deque[tuple[int, str, list[int]]] = deque()  # (position, replica, tokens)
        self._next = 0
        self._tokens = 0
        self._members: dict[str, _Member] = {}
        self._joins = 0
        self._rates: dict[str, tuple[list[float], list[float]]] = {}  # replica -> observed (sent, accepted) totals
        self.dropped = 0

    # ---- members ------------------------------------------------------------------------

    def join(self, replica: str, tokenizer_id: str | None) -> tuple[str, int]:
        """Register `replica`; this log's epoch and the position to read from after loading the trie file."""
        self._check_tokenizer(tokenizer_id)
        self._heard(replica)
        return self.epoch, self.saved_through

    def leave(self, replica: str) -> bool:
        """`replica` stops; True if no other member is live, so that it is the one to save the trie last."""
        self._members.pop(replica, None)
        return not self.live()

    def live(self) -> list[str]:
        """Members heard from within the timeout, longest joined first."""
        now = self.clock()
        alive = [(m.joined, name) for name, m in self._members.items() if now - m.heard <= self.member_timeout_s]
        return [name for _, name in sorted(alive)]

    def saver(self) -> str | None:
        """The member that keeps the periodic saves of the trie file."""
        alive = self.live()
        return alive[0] if alive else None

    def saved(self, replica: str, position: int) -> None:
        """`replica` saved a trie holding every answer before `position`."""
        self._heard(replica)
        self.saved_through = max(0, min(position, self._next))

    # ---- answers ------------------------------------------------------------------------

    def publish(self, replica: str, tokenizer_id: str | None, answers: Sequence[tuple[int, Sequence[int]]]) -> int:
        """Add `replica`'s numbered answers; returns how many were new (retries and empty answers add nothing)."""
        self._check_tokenizer(tokenizer_id)
        member = self._heard(replica)
        added = 0
        for serial, tokens in sorted(answers, key=lambda answer: answer[0]):
            if serial <= member.serial:
                continue
            member.serial = serial
            if not tokens:
                continue
            self._log.append((self._next, replica, [int(t) for t in tokens]))
            self._next += 1
            self._tokens += len(tokens)
            added += 1
        self._trim()
        return added

    def since(self, replica: str, epoch: str | None, position: int) -> Delivery:
        """The other members' answers at `position` and after (from the start if `epoch` is not this log's)."""
        self._heard(replica)
        if epoch != self.epoch:
            position = 0
        first = self._log[0][0] if self._log else self._next
        missed = max(0, min(first, self._next) - position)
        answers = [tokens for at, author, tokens in self._log if at >= position and author != replica]
        return Delivery(self.epoch, answers, self._next, missed)

    @property
    def position(self) -> int:
        """The position the next published answer gets."""
        return self._next

    def _trim(self) -> None:
        while self._log and (len(self._log) > self.max_answers or self._tokens > self.max_tokens):
            _, _, tokens = self._log.popleft()
            self._tokens -= len(tokens)
            self.dropped += 1

    # ---- calibration --------------------------------------------------------------------

    def exchange_rates(
        self, replica: str, sent: Sequence[float], accepted: Sequence[float]
    ) -> tuple[list[float], list[float]]:
        """Keep `replica`'s observed totals; the sums of every other replica's (past members' included) that count
        the same cells (a replica of another version, whose calibration has other cells, is left out of them)."""
        self._heard(replica)
        self._rates[replica] = ([float(x) for x in sent], [float(x) for x in accepted])
        cells = len(sent)
        others = [totals for name, totals in self._rates.items() if name != replica and len(totals[0]) == cells]
        return (
            [sum(totals[0][i] for totals in others) for i in range(cells)],
            [sum(totals[1][i] for totals in others) for i in range(cells)],
        )

    # ---- metrics ------------------------------------------------------------------------

    def post_metrics(self, replica: str, text: str) -> None:
        self._heard(replica).metrics = text

    def metrics(self) -> dict[str, str]:
        """The latest metrics text of each live member."""
        return {name: self._members[name].metrics for name in self.live() if self._members[name].metrics}

    def stats(self) -> dict[str, int | str | None]:
        return {
            "epoch": self.epoch,
            "position": self._next,
            "answers": len(self._log),
            "tokens": self._tokens,
            "dropped": self.dropped,
            "members": len(self.live()),
            "saved_through": self.saved_through,
        }

    # ---- internals ----------------------------------------------------------------------

    def _heard(self, replica: str) -> _Member:
        member = self._members.get(replica)
        if member is None:
            member = self._members[replica] = _Member(self._joins, self.clock())
            self._joins += 1
        member.heard = self.clock()
        return member

    def _check_tokenizer(self, tokenizer_id: str | None) -> None:
        if tokenizer_id is None:
            return
        if self.tokenizer_id is None:
            self.tokenizer_id = tokenizer_id
        elif tokenizer_id != self.tokenizer_id:
            raise TokenizerMismatch(
                f"this hub's answers are in another tokenizer's ids (vocabulary {self.tokenizer_id[:12]}, "
                f"this replica's is {tokenizer_id[:12]})"
            )
