"""The trie file: loaded once at start, saved every few minutes and at shutdown.

`TokenTrie.save` snapshots the trie under its lock (saves run while requests are served) and
writes a temporary file that replaces the target in one step, so a crash or a failed save
leaves the last good file as it was; here a failure is logged and counted, never raised.
Replicas that share their answers hold the same trie, so one of them saves it: the hub's
chosen saver periodically, the last to stop at shutdown; it learns everything published
before each save, and tells the hub how far the file reaches (a restarted replica reads on
from there).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..drafting.trie import TokenTrie
from ..drafting.triefile import remove_stale_scratch
from ..sharing import TrieSync

log = logging.getLogger("lookahead.server")


def load_trie(path: str | os.PathLike | None) -> TokenTrie | None:
    """The trie saved at `path`, or None when there is none yet (a first start).

    Temporary files that a killed save of `path` left behind are removed first.
    """
    if path is None:
        return None
    target = Path(path)
    if not target.parent.is_dir():
        raise ValueError(f"--trie-path {path}: the directory {target.parent} does not exist")
    remove_stale_scratch(target)
    if not target.exists():
        return None
    try:
        return TokenTrie.load(target)
    except (OSError, ValueError) as err:
        raise ValueError(f"{err}; move the file away to start with an empty trie") from err


class TrieSaver:
    """Saves `trie` every `every_s` seconds when requests have ended since, and on demand.

    With `sharing`, the periodic saves are left to the replica the hub picks.
    """

    def __init__(
        self,
        trie: TokenTrie,
        path: str | os.PathLike,
        every_s: float,
        changes: Callable[[], int],
        record: Callable[[str], None] = lambda result: None,
        sharing: TrieSync | None = None,
    ) -> None:
        self.trie, self.path, self.every_s = trie, Path(path), every_s
        self._changes, self._record = changes, record
        self.sharing = sharing
        self._saved_at = changes()

    def changed(self) -> bool:
        """Requests have ended since the last save."""
        return self._changes() != self._saved_at

    def save(self) -> bool:
        """One save; a failure is logged and counted, never raised (the last good file stays)."""
        seen = self._changes()
        position = self.sharing.before_save() if self.sharing else 0
        try:
            self.trie.save(self.path)
        except Exception:
            log.exception("saving the trie to %s failed; the previous file is kept", self.path)
            self._record("error")
            return False
        self._saved_at = seen
        if self.sharing:
            self.sharing.saved(position)
        self._record("ok")
        log.info("trie saved to %s (%d nodes)", self.path, len(self.trie))
        return True

    async def run(self) -> None:
        """The periodic saves, off the event loop; cancel the task to stop them."""
        while True:
            await asyncio.sleep(self.every_s)
            if self.sharing is not None:
                if await asyncio.to_thread(self.sharing.is_saver):
                    await asyncio.to_thread(self.save)
            elif self.changed():
                await asyncio.to_thread(self.save)
