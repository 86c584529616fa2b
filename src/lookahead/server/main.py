"""`lookahead serve`: load the trie, build the engine and the app, run uvicorn until SIGINT or SIGTERM.

With `--replicas N` (N > 1) or `--ray-address`, the same app runs as N replicas on Ray Serve
instead (replicas.py).

Either signal starts a drain while the socket still listens: new and queued requests are
answered 503 at once, and running generations get `--drain-timeout` seconds to finish before
they are ended with an error event (a second signal ends them at once). Then uvicorn's own
shutdown closes the socket and the connections, and the app's lifespan end saves the trie.
SIGTERM then exits 0 (a clean stop); SIGINT exits 130, as an interrupted command does.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from ..drafting.trie import TokenTrie
from .app import Drain, ServerSettings, create_app
from .persistence import load_trie
from .replicas import check_replica_options, serve_replicas

if TYPE_CHECKING:
    from ..engine import LookaheadEngine

GRACEFUL_SHUTDOWN_S = 5
"""uvicorn's wait for connections after the drain: by then every answer has ended, so it is short."""

log = logging.getLogger("lookahead.server")


class _Server(uvicorn.Server):
    """Drains the app before uvicorn's shutdown, and remembers the signal that stopped it.

    uvicorn re-raises a captured SIGINT after shutdown, but from inside asyncio.run, whose own
    SIGINT handling can swallow it as a late cancellation of the finished main task; `serve`
    then raises KeyboardInterrupt itself, so the command exits as interrupted either way.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.stopped_by: int | None = None
        self.signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.stopped_by = self.stopped_by or sig
        self.signals += 1
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        log.info("draining: new requests are refused, running ones may finish")
        await self.drain(lambda: self.signals > 1 or self.force_exit)
        await super().shutdown(sockets)


def serve(
    args: argparse.Namespace, make_engine: Callable[[argparse.Namespace, TokenTrie | None], LookaheadEngine]
) -> int:
    """Run the server the command line describes; returns the exit code."""
    if not args.save_every > 0:
        raise ValueError(f"--save-every must be a positive number of minutes, got {args.save_every}")
    if not 0 <= args.drain_timeout < math.inf:
        raise ValueError(f"--drain-timeout must be a finite number of seconds >= 0, got {args.drain_timeout}")
    on_ray = args.replicas != 1 or args.ray_address is not None
    if on_ray:
        check_replica_options(args)
    trie = load_trie(args.trie_path)  # before the model loads: a bad path fails in a second, not after it
    from ..models import DEFAULT_MODEL  # transformers: seconds to import, so after the checks

    settings = ServerSettings(
        model_name=args.model or DEFAULT_MODEL,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        trie_path=args.trie_path,
        save_every_s=args.save_every * 60,
        drain_timeout_s=args.drain_timeout,
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    if on_ray:
        return serve_replicas(args, settings, make_engine)  # each replica loads the trie itself
    if trie is not None:
        log.info("trie loaded from %s (%d nodes)", args.trie_path, len(trie))
    app = create_app(make_engine(args, trie), settings)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, app.state.drain)
    # uvicorn hands the SIGTERM it caught back to the handler it found once it has stopped; this one
    # makes that a no-op (exit 0, not death by the signal), and stops the server if it comes earlier.
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if server.stopped_by == signal.SIGINT:
        raise KeyboardInterrupt
    return 0 if server.started else 1
