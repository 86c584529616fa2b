"""Prometheus metrics of one server: traffic, tokens, forward passes, the trie, the queue, latency.

Each app has its own registry (several apps in one process, as in tests, do not clash); the
process collector adds resident memory and CPU time, which the load check reads to see that
memory stays flat.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..sharing import TrieSync
from .scheduler import Job, Scheduler

if TYPE_CHECKING:
    from ..engine import LookaheadEngine

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


class Metrics:
    def __init__(self, engine: LookaheadEngine, scheduler: Scheduler, sharing: TrieSync | None = None) -> None:
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        self.http = Counter(
            "lookahead_http_requests",
            "HTTP requests by route and status (499: the client left before its answer)",
            ["route", "status"],
            registry=registry,
        )
        self.generations = Counter(
            "lookahead_generations",
            "Generations by endpoint and outcome (finish reason, cancelled or error)",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter("lookahead_prompt_tokens", "Prompt tokens of accepted requests", registry=registry)
        self.tokens = Counter("lookahead_generated_tokens", "New tokens generated", registry=registry)
        self.steps = Counter(
            "lookahead_forward_steps", "Steps after prefill, per generation (a batched pass counts once a row)",
            registry=registry,
        )  # fmt: skip
        self.tokens_per_step = Histogram(
            "lookahead_tokens_per_step",
            "New tokens per forward pass, per generation",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8, 12),
            registry=registry,
        )
        self.latency = Histogram(
            "lookahead_request_latency_seconds",
            "Arrival to last token, queueing included",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_wait = Histogram(
            "lookahead_queue_wait_seconds",
            "Arrival to the start of generation",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.trie_saves = Counter(
            "lookahead_trie_saves", "Saves of the trie file by result", ["result"], registry=registry
        )
        Gauge("lookahead_queue_length", "Requests waiting for the model", registry=registry).set_function(
            lambda: scheduler.waiting
        )
        Gauge("lookahead_busy", "1 while a generation runs", registry=registry).set_function(
            lambda: float(scheduler.busy)
        )
        Gauge("lookahead_batch_size", "Generations decoded together now", registry=registry).set_function(
            lambda: scheduler.running
        )
        Gauge(
            "lookahead_block_width", "Tokens per row of the last step's forward pass", registry=registry
        ).set_function(lambda: scheduler.batch.last_width)
        Gauge("lookahead_trie_nodes", "Nodes in the shared trie", registry=registry).set_function(
            lambda: len(engine.trie)
        )
        if sharing is not None:
            answers = Gauge(
                "lookahead_shared_answers",
                "Answers shared with the other replicas: published, applied (theirs, learned here), missed "
                "(dropped by the hub before this replica read them), given_up (never published: the hub was away)",
                ["kind"],
                registry=registry,
            )
            for kind in ("published", "applied", "missed", "given_up"):
                answers.labels(kind).set_function(lambda kind=kind: getattr(sharing, kind))
            Gauge("lookahead_sharing_failures", "Exchanges with the hub that failed", registry=registry).set_function(
                lambda: sharing.failures
            )

    def finished(self, job: Job) -> None:
        """Record one ended job (called once per job, from the scheduler)."""
        self.generations.labels(job.label, job.outcome).inc()
        if job.finished is not None:
            self.latency.labels(job.label).observe(job.finished - job.submitted)
        if job.started is not None:
            self.queue_wait.observe(job.started - job.submitted)
        for output in job.outputs:
            stats = output.stats
            self.tokens.inc(stats.new_tokens)
            self.steps.inc(stats.steps)
            self.tokens_per_step.observe(stats.edl)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def labelled(texts: dict[str, str]) -> bytes:
    """Several replicas' metrics texts as one exposition: every series gets a `replica` label."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [
                sample._replace(labels={**sample.labels, "replica": replica}) for sample in family.samples
            ]
    return generate_latest(_Families(list(families.values())))  # type: ignore[arg-type]


class CountRequests:
    """ASGI middleware counting every response by route and status (unknown paths as 'other')."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
