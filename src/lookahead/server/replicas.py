"""`lookahead serve --replicas N`: N copies of the OpenAI-compatible app on Ray Serve, sharing their answers.

Needs the `ray` extra (`pip install 'lookahead[ray]'`). Each replica is a Ray actor with its
share of the cluster's CPUs (or one GPU) and its own engine, serving the same app as the
single-process server behind Serve's HTTP proxy (ray_replica.py); the replicas share the
answers they finish through one hub, so every trie learns from all the traffic.

Without `--ray-address` the command starts a local Ray instance sized to the machine and stops
it on exit; with one it joins that cluster and leaves it running. SIGTERM or SIGINT stops the
app in two steps: every replica drains as the single-process server does (new and queued
requests get 503, running ones get `--drain-timeout` seconds), then Serve stops them; each
publishes what it has left and leaves the hub, and the last one saves the trie to
`--trie-path`. A second signal stops waiting (the trie is not saved). A replica that fails is
restarted by Serve; it loads the trie file and reads the hub's log on from where that file ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..drafting.trie import TokenTrie
    from ..engine import LookaheadEngine

log = logging.getLogger("lookahead.server")

APP_NAME = "lookahead"


def check_replica_options(args: argparse.Namespace) -> None:
    """Refuse a bad scale-out set-up in a second, before any model loads (ValueError: one line, exit 2)."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {args.replicas}")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"--replicas needs Ray Serve, and {err.name} is not installed: pip install 'lookahead[ray]'"
        ) from None
    if args.ray_address:
        reach(args.ray_address)


def reach(address: str, timeout_s: float = 5.0) -> None:
    """Check that a Ray cluster's address answers (ray.init would retry it for a minute)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address}: expected HOST:PORT (the head node's GCS address)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ValueError(f"--ray-address {address}: no Ray cluster answers there ({err.strerror or err})") from None


def replica_resources(replicas: int, cpus: int, device: str) -> tuple[dict[str, float], int]:
    """Ray resources and torch threads of one replica: an equal share of the cluster's CPUs, or one GPU."""
    share = max(1, cpus // replicas)
    if device.startswith("cuda"):
        return {"num_cpus": 1, "num_gpus": 1}, share
    return {"num_cpus": share}, share


def serve_replicas(
    args: argparse.Namespace,
    settings: Any,
    make_engine: Callable[[argparse.Namespace, TokenTrie | None], LookaheadEngine],
) -> int:
    """Deploy the replicas and serve until SIGTERM (exit 0) or SIGINT (exit 130); returns the exit code."""
    import ray
    from ray import serve

    signals: list[int] = []
    stop = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        signals.append(sig)
        stop.set()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    started_ray = not args.ray_address
    try:
        if started_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a Ray of our own reports to no one
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=args.ray_address, logging_level=logging.WARNING)
        for sig in previous:  # after ray.init, which installs a SIGTERM handler of its own
            signal.signal(sig, on_signal)
        log.info("Ray %s at %s", "started" if started_ray else "joined", ray.get_runtime_context().gcs_address)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        resources, threads = replica_resources(args.replicas, cpus, args.device)
        replica_args = argparse.Namespace(**{**vars(args), "threads": args.threads or threads})
        from .ray_replica import ReplicaPlan, deployment

        app = deployment(ReplicaPlan(replica_args, make_engine, settings), args.replicas, resources)
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)  # waits until the replicas serve
        except RuntimeError as err:  # a replica that cannot start (a bad --model, say): its log above says why
            raise ValueError(f"the replicas did not start: {str(err).splitlines()[0]}") from None
        log.info("serving on http://%s:%d: %d replicas, %s each", args.host, args.port, args.replicas, resources)
        stop.wait()
        stop.clear()
        log.info("draining: new requests are refused, running ones may finish; then the last replica saves the trie")
        drained = threading.Thread(target=lambda: _stop_app(serve), daemon=True)
        drained.start()
        while drained.is_alive() and not stop.wait(0.1):  # a second signal stops waiting
            pass
        if drained.is_alive():
            log.warning("stopping now: the replicas' running requests end and the trie is not saved")
    finally:
        if ray.is_initialized():
            if started_ray:
                serve.shutdown()
            ray.shutdown()  # stops the Ray this command started; only disconnects from a joined one
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signals and signals[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return 0


def _stop_app(serve: Any) -> None:
    """Drain every replica (as the single-process server drains), then delete the app (the last replica saves)."""
    try:
        from .ray_replica import DEPLOYMENT

        serve.get_deployment_handle(DEPLOYMENT, APP_NAME).broadcast("drain").results()
    except Exception:
        log.exception("draining the replicas failed; stopping them anyway")
    serve.delete(APP_NAME)
