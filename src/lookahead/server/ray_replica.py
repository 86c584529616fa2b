"""The Ray Serve side of `lookahead serve --replicas N`: what runs in each replica, and the deployment.

Imported only once Ray Serve is known to be installed (replicas.py checks first). Each
replica builds its own engine and app (`build_replica_app`), shares its answers through the
hub — a deployment-scoped actor, which Serve's controller starts with the deployment,
replaces (empty) if it dies and removes with it — and names itself in every response.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig

from ..sharing import AnswerHub, TrieSync
from .app import ServerSettings, create_app
from .persistence import load_trie

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..drafting.trie import TokenTrie
    from ..engine import LookaheadEngine

log = logging.getLogger("lookahead.server")

DEPLOYMENT = "lookahead"
HUB = "answer-hub"
"""The hub's name among the deployment's actors."""
HUB_TIMEOUT_S = 10.0
"""How long a replica waits for the hub before it counts the exchange as failed and goes on."""
STOP_MARGIN_S = 60.0
"""Time Serve gives a replica past the drain to publish, save and stop, before it is killed."""
REPLICA_HEADER = "X-Lookahead-Replica"


class RayHub:
    """The Hub protocol over the hub actor: each call waits at most `timeout_s` (then fails, and sharing retries).

    Serve replaces a hub actor that died with a new one, which an old handle does not reach:
    after a failed call the handle is looked up again (`resolve`) on the next one.
    """

    def __init__(self, resolve: Callable[[], Any], timeout_s: float = HUB_TIMEOUT_S) -> None:
        self.resolve, self.timeout_s = resolve, timeout_s
        self._handle: Any = None

    def _ask(self, method: str, *args: Any) -> Any:
        if self._handle is None:
            self._handle = self.resolve()
        try:
            return ray.get(getattr(self._handle, method).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.RayError:
            self._handle = None
            raise

    def __getattr__(self, method: str) -> Callable[..., Any]:
        """Every method of the Hub protocol (sharing/sync.py), as a call to the actor's method of that name.

        Private and special names are not forwarded: copy, pickle and `hasattr` see a plain object.
        """
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self._ask(method, *args)


@dataclass(frozen=True)
class ReplicaPlan:
    """Everything a replica needs to build its app, sent to every replica actor."""

    args: argparse.Namespace
    make_engine: Callable[[argparse.Namespace, TokenTrie | None], LookaheadEngine]
    settings: ServerSettings


def build_replica_app(plan: ReplicaPlan) -> FastAPI:
    """Runs in each replica actor: the trie file, the engine, the sharing rounds and the app."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    context = serve.get_replica_context()
    replica = f"{context.replica_id.unique_id}-{uuid.uuid4().hex[:6]}"  # new at each start: answers are numbered anew
    trie = load_trie(plan.settings.trie_path)
    engine = plan.make_engine(plan.args, trie)
    hub = RayHub(lambda: serve.get_deployment_actor(HUB))
    sharing = TrieSync(engine.trie, hub, replica, calibration=engine.policy.calibration)
    app = create_app(engine, plan.settings, sharing)
    app.add_middleware(NameReplica, replica=replica)
    log.info("replica %s ready (%s, trie of %d nodes)", replica, plan.settings.model_name, len(engine.trie))
    return app


class NameReplica:
    """ASGI middleware: every HTTP response carries X-Lookahead-Replica."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@serve.ingress()
class LookaheadReplica:
    """One replica: the app is built on the replica (its engine, trie and sharing); `drain` is called on every
    replica by the command when it is told to stop."""

    def __init__(self, plan: ReplicaPlan) -> None:
        self.plan = plan

    def __serve_build_asgi_app__(self) -> Any:
        return build_replica_app(self.plan)

    async def drain(self) -> None:
        await self.app.state.drain(lambda: False)


def deployment(plan: ReplicaPlan, replicas: int, resources: dict[str, float]) -> Any:
    """The bound application: `replicas` replicas with `resources` each, and one answer hub beside them."""
    hub = DeploymentActorConfig(name=HUB, actor_class=ray.remote(AnswerHub), actor_options={"num_cpus": 0})
    settings = plan.settings
    return serve.deployment(
        LookaheadReplica,
        name=DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options=resources,
        max_ongoing_requests=settings.max_batch + settings.max_queue + 8,  # the replica's own queue answers 503
        graceful_shutdown_timeout_s=settings.drain_timeout_s + STOP_MARGIN_S,
        max_constructor_retry_count=2,  # a replica that cannot load its model will not on a 20th try
        deployment_actors=[hub],
    ).bind(plan)
