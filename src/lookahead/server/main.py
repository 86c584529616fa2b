"""`lookahead serve`: load the trie, build the engine and the app, run uvicorn until SIGINT or SIGTERM.

uvicorn turns either signal into a graceful shutdown: it stops accepting connections, lets
running responses finish (cutting them off after a few seconds), then runs the app's lifespan
end, which stops the worker and saves the trie.
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from ..decoding.engine import LookaheadEngine
from ..drafting.trie import TokenTrie
from ..models import DEFAULT_MODEL
from .app import ServerSettings, create_app
from .persistence import load_trie

GRACEFUL_SHUTDOWN_S = 10


class _Server(uvicorn.Server):
    """Remembers the signal that stopped it.

    uvicorn re-raises a captured SIGINT after shutdown, but from inside asyncio.run, whose own
    SIGINT handling can swallow it as a late cancellation of the finished main task; `serve`
    then raises KeyboardInterrupt itself, so the command exits as interrupted either way.
    """

    stopped_by: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopped_by = self.stopped_by or sig
        super().handle_exit(sig, frame)


def serve(
    args: argparse.Namespace, make_engine: Callable[[argparse.Namespace, TokenTrie | None], LookaheadEngine]
) -> int:
    """Run the server the command line describes; returns the exit code."""
    if not args.save_every > 0:
        raise ValueError(f"--save-every must be a positive number of minutes, got {args.save_every}")
    trie = load_trie(args.trie_path)  # before the model loads: a bad path fails in a second, not after it
    settings = ServerSettings(
        model_name=args.model or DEFAULT_MODEL,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        trie_path=args.trie_path,
        save_every_s=args.save_every * 60,
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if trie is not None:
        logging.getLogger("lookahead.server").info("trie loaded from %s (%d nodes)", args.trie_path, len(trie))
    app = create_app(make_engine(args, trie), settings)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    server.run()
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    return 0 if server.started else 1
