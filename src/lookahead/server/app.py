"""The FastAPI app: OpenAI-compatible routes over one engine, one shared trie and one fair queue.

Each generation request is checked and turned into a plan, queued, and answered from the
worker's text deltas, as one JSON body or as server-sent events. A watcher per request hears
the client leave and cancels its job, so a dropped client frees the model at once. `drain`
(which `lookahead serve` calls on SIGTERM or SIGINT, before the listening socket closes)
answers new and queued requests 503 and gives the running ones a bounded time to finish.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..sharing import TrieSync
from ..sourceview import SourceView
from . import errors, openapi
from .errors import APIError
from .exchange import Exchange
from .generation import Plan, plan_chat, plan_completion
from .guard import LimitBody, RequireApiKey
from .logprobs import LogprobFormat
from .metrics import CountRequests, Metrics, labelled
from .persistence import TrieSaver
from .scheduler import Job, QueueFull, Scheduler, Stopping
from .schemas import ChatRequest, CompletionRequest, GenerationRequest, Reply

if TYPE_CHECKING:
    from ..engine import LookaheadEngine

ROUTES = {"/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    """The name clients pass as `model`; any other name is a 404."""
    api_key: str | None = None
    max_queue: int = 32
    """Requests that may wait for a place in the batch; more are answered 503 with Retry-After."""
    max_batch: int = 8
    """Generations decoded together (a request with n choices takes n)."""
    trie_path: str | None = None
    save_every_s: float = 600.0
    max_body_bytes: int = 2 * 1024 * 1024
    drain_timeout_s: float = 5.0
    """How long a stopping server lets running generations go on before it ends them."""


Drain = Callable[[Callable[[], bool]], Awaitable[None]]
"""`app.state.drain(interrupted)`: stop taking requests and end the running ones (sooner once `interrupted()`)."""


def create_app(engine: LookaheadEngine, settings: ServerSettings, sharing: TrieSync | None = None) -> FastAPI:
    """An app serving `engine`; its lifespan starts the worker and keeps the trie file.

    With `sharing` (a replica of several), every finished answer is shared with the other
    replicas, /metrics shows every replica's series labelled by replica, and the trie file is
    saved by one replica only (see persistence.py).
    """
    scheduler = Scheduler(engine.batch(settings.max_batch), settings.max_queue)
    metrics = Metrics(engine, scheduler, sharing)
    if sharing is not None:
        sharing.report = lambda: metrics.render().decode()

    def finished(job: Job) -> None:
        metrics.finished(job)
        if sharing is not None and job.started is not None:  # what a cancelled job generated was learned too
            sharing.share([generation.transcript.tokens for generation in job.generations])

    scheduler.on_finish = finished
    saver = None
    if settings.trie_path:
        saver = TrieSaver(
            engine.trie,
            settings.trie_path,
            settings.save_every_s,
            lambda: scheduler.completed,
            lambda result: metrics.trie_saves.labels(result).inc(),
            sharing,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        if sharing is not None:
            await asyncio.to_thread(sharing.start)
        periodic = asyncio.create_task(saver.run()) if saver else None
        try:
            yield
        finally:
            if periodic:
                periodic.cancel()
            await asyncio.to_thread(scheduler.close)
            last = await asyncio.to_thread(sharing.stop) if sharing is not None else True
            if saver and last:
                await asyncio.to_thread(saver.save)

    app = FastAPI(title="Lookahead", lifespan=lifespan, docs_url=None, redoc_url=None)
    errors.install(app)
    openapi.install(app, settings.model_name)
    app.add_middleware(LimitBody, limit=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(RequireApiKey, key=settings.api_key)
    app.add_middleware(CountRequests, metrics=metrics, routes=ROUTES)
    app.state.drain = lambda interrupted: scheduler.drain(settings.drain_timeout_s, interrupted)
    started = int(time.time())

    def decode_text(ids: Sequence[int]) -> str:
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    card = {"id": settings.model_name, "object": "model", "created": started, "owned_by": "lookahead"}

    def check_model(name: str) -> None:
        if name != settings.model_name:
            message = f"the model {name!r} does not exist; this server serves {settings.model_name!r}"
            raise APIError(404, message, "model", "model_not_found")

    async def answer(request: Request, body: GenerationRequest, plan: Plan, reply: Reply, label: str) -> Response:
        if plan.choices > settings.max_batch:
            message = f"n={plan.choices} choices do not fit this server's batch of {settings.max_batch}"
            raise APIError(400, message, "n", "invalid_value")
        try:
            job = scheduler.submit(plan.generations(engine), label)
        except Stopping as stopping:
            retry = {"Retry-After": str(stopping.retry_after)}
            raise APIError(503, "the server is shutting down", code="server_shutting_down", headers=retry) from None
        except QueueFull as full:
            message = f"the server is busy ({scheduler.waiting} requests waiting); retry later"
            raise APIError(503, message, code="queue_full", headers={"Retry-After": str(full.retry_after)}) from None
        metrics.prompt_tokens.inc(len(plan.prompt_ids))
        logprobs = LogprobFormat(engine.tokenizer, reply.chat) if "logprobs" in plan.options else None
        views = [SourceView(decode_text) for _ in range(plan.choices)] if body.lookahead_sources else None
        exchange = Exchange(request, job, plan, reply, logprobs, views)
        first = await exchange.first()
        if not body.stream:
            return JSONResponse(await exchange.whole())
        events = exchange.events(first, body.include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    page = _page(settings.model_name)

    @app.get("/", response_class=HTMLResponse, responses=openapi.PAGE)
    async def home() -> HTMLResponse:
        """A page to try the server in a browser: the answer streams, each token coloured by its draft's source."""
        return HTMLResponse(page)

    @app.get("/health", response_model=None, responses=openapi.HEALTH)
    async def health() -> JSONResponse:
        """200 while serving; 503 once stopping, so that a load balancer sends no more requests."""
        body = {
            "status": "stopping" if scheduler.stopping else "ok",
            "model": settings.model_name,
            "queue_length": scheduler.waiting,
            "busy": scheduler.busy,
            "running": scheduler.running,
            "trie_nodes": len(engine.trie),
        }
        return JSONResponse(body, 503 if scheduler.stopping else 200)

    @app.get("/metrics", response_class=Response, responses=openapi.PROMETHEUS)
    async def prometheus() -> Response:
        if sharing is None:
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
        texts = {**await asyncio.to_thread(sharing.peer_metrics), sharing.replica: metrics.render().decode()}
        return Response(labelled(texts), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=None, responses=openapi.MODEL_LIST)
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}", response_model=None, responses=openapi.MODEL_CARD)
    async def model(name: str) -> dict:
        check_model(name)
        return card

    @app.post("/v1/completions", responses=openapi.COMPLETIONS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        plan = plan_completion(engine, body)
        return await answer(request, body, plan, Reply(chat=False, model=settings.model_name), "completions")

    @app.post("/v1/chat/completions", responses=openapi.CHAT)
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_model(body.model)
        plan = plan_chat(engine, body)
        return await answer(request, body, plan, Reply(chat=True, model=settings.model_name), "chat")

    return app


def _page(model_name: str) -> str:
    """The page, its model name written in as a JavaScript string (no `<` in it, so it cannot end the script)."""
    text = resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")
    return text.replace('/*MODEL*/""', json.dumps(model_name).replace("<", "\\u003c"))
