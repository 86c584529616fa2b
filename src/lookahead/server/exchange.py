"""One request's exchange with its queued job: one JSON answer, or the answer as server-sent events.

A watcher listens for the client to hang up and cancels the job, whether it is still queued or
already generating; however the exchange ends, the job is cancelled (harmless once finished),
so no job outlives its client. A job cancelled by its client leaving is answered 499 (nginx's
"client closed request": no one reads it, but /metrics counts it apart from the server's own
503s); one cancelled because the server stops is a 503, or in a stream an error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from ..decoding.generation import GenerationOutput
from ..decoding.sampling import TokenLogprob
from ..sourceview import SourceView
from .errors import APIError, error_body
from .generation import Plan
from .logprobs import LogprobFormat
from .scheduler import Cancelled, ChoiceDelta, Job
from .schemas import Reply, sse, usage

log = logging.getLogger("lookahead.server")
T = TypeVar("T")


CLIENT_CLOSED = 499


def failure(err: Exception, client_left: bool = False) -> APIError:
    """The error status for a generation that ended without an answer."""
    if isinstance(err, Cancelled) and client_left:
        return APIError(CLIENT_CLOSED, "the client closed the request before its answer", code="client_closed")
    if isinstance(err, Cancelled):
        return APIError(503, "the request was cancelled: the server is stopping", code="server_shutting_down")
    if isinstance(err, ValueError):
        return APIError(400, str(err), code="invalid_value")
    log.error("generation failed", exc_info=err)
    return APIError(500, "internal server error; see the server log")


class Exchange:
    def __init__(
        self,
        request: Request,
        job: Job,
        plan: Plan,
        reply: Reply,
        logprobs: LogprobFormat | None,
        views: list[SourceView] | None = None,
    ) -> None:
        self.job, self.plan, self.reply = job, plan, reply
        self.logprobs = logprobs
        """How log-probabilities are rendered, when the request asked for them."""
        self.views = views
        """Per choice, its tokens' sources as named text pieces, when the request asked for them."""
        self.client_left = False
        self._watcher = asyncio.create_task(self._cancel_on_disconnect(request))
        self._deltas = job.deltas()
        self._sent = [0] * plan.choices
        """Per choice, tokens streamed so far (their log-probabilities and sources went with them)."""
        self._offsets = [0] * plan.choices
        """Per choice, the text offset of its next streamed token (completions' `text_offset`)."""

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.client_left = True  # before the cancellation it causes is heard
        self.job.cancel()

    def close(self) -> None:
        self._watcher.cancel()
        self.job.cancel()

    def usage(self) -> dict[str, int]:
        return usage(len(self.plan.prompt_ids), sum(len(output.token_ids) for output in self.job.outputs))

    async def first(self) -> ChoiceDelta | None:
        """The first text delta; None if the answer is empty. An error here still gets its status code."""
        return await self._next_or_fail(anext(self._deltas, None))

    async def whole(self) -> dict:
        """The rest of the answer, as one response body."""

        async def drain() -> None:
            async for _ in self._deltas:
                pass

        await self._next_or_fail(drain())
        self.close()
        choices = [(out.text, out.finish_reason, self._body(0, out.logprobs)) for out in self.job.outputs]
        return self.reply.full(choices, self.usage())

    async def events(self, first: ChoiceDelta | None, include_usage: bool) -> AsyncIterator[str]:
        """The answer as OpenAI stream chunks, ending with `[DONE]`; an error after the headers is an event
        before it (when the client is still there to read it). A chunk carries the log-probabilities of the
        tokens generated since the choice's previous chunk; its closing chunk, any left."""
        opened: set[int] = set()

        def chunk(delta: ChoiceDelta, finish_reason: str | None = None) -> str:
            index = delta.index
            logprobs, sources = self._streamed(delta), self._sources(delta)
            body = self.reply.chunk(index, delta.text, finish_reason, index not in opened, logprobs, sources)
            opened.add(index)
            return sse(body)

        try:
            yield chunk(first or ChoiceDelta(0, ""))
            async for delta in self._deltas:
                yield chunk(delta)
            for index, output in enumerate(self.job.outputs):
                yield chunk(self._rest(index, output), output.finish_reason)
            if include_usage:
                yield sse(self.reply.usage_chunk(self.usage()))
        except Exception as err:
            if self.client_left:
                return  # no one is there to read an error
            error = failure(err)
            yield sse(error_body(error.status, error.message, error.param, error.code))
        finally:
            self.close()
        yield sse("[DONE]")

    def _rest(self, index: int, output: GenerationOutput) -> ChoiceDelta:
        """What the closing chunk of choice `index` carries: the tokens no delta took (an end-of-sequence, say)."""
        sent = self._sent[index]
        logprobs = output.logprobs[sent:] if output.logprobs is not None else None
        return ChoiceDelta(index, "", logprobs or None, output.token_ids[sent:], output.sources[sent:],
                           output.stats.steps, closing=True)  # fmt: skip

    def _streamed(self, delta: ChoiceDelta) -> dict | None:
        self._sent[delta.index] += len(delta.tokens)
        if delta.logprobs is None:
            return None
        body = self._body(self._offsets[delta.index], delta.logprobs)
        if self.logprobs is not None:
            self._offsets[delta.index] += self.logprobs.text_length(delta.logprobs)
        return body

    def _sources(self, delta: ChoiceDelta) -> dict | None:
        """The `lookahead` extension of a chunk: its tokens' text pieces by source, and the choice's steps so far."""
        if self.views is None:
            return None
        view = self.views[delta.index]
        pieces = view.add(delta.tokens, delta.sources) + (view.flush() if delta.closing else [])
        return {"pieces": [{"text": text, "source": name} for text, name in pieces], "tokens": len(delta.tokens),
                "steps": delta.steps}  # fmt: skip

    def _body(self, offset: int, records: list[TokenLogprob] | None) -> dict | None:
        return None if records is None or self.logprobs is None else self.logprobs.body(records, offset)

    async def _next_or_fail(self, step: Awaitable[T]) -> T:
        try:
            return await step
        except BaseException as err:
            self.close()
            if isinstance(err, Exception):
                raise failure(err, self.client_left) from None
            raise
