"""Everything Lookahead reads of vLLM's internals, in one place, for the tested vLLM range only.

vLLM's `custom_class` hook calls `propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, ...)` with the batch's rows but not which request each row is, which
requests finished, or how many drafts each row carried — all of which a drafter that learns
per request needs. They live on the model runner that makes the call, so they are read off
its frame: `runner.input_batch` (request ids by row, tokens), `runner.requests` (prompts,
sampling limits) and the step's `scheduler_output` (finished ids, tokens scheduled per
request, the drafts it verified). Those names are vLLM's, not a public API: SUPPORTED is
the range they were checked against, and other versions are refused at start.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .chains import TAIL, Batch, Row

OPT_OUT = "lookahead"
"""`SamplingParams(extra_args={"lookahead": False})`: this request is decoded without drafts."""
SUPPORTED = ((0, 32), (0, 33))
"""vLLM versions [from, to) whose model runner this module reads."""


def check_version(version: str) -> None:
    """RuntimeError in one line unless `version` (vllm.__version__) is in SUPPORTED."""
    parts = version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = None
    low, high = SUPPORTED
    if major_minor is None or not low <= major_minor < high:
        last = (high[0], high[1] - 1)
        tested = f"{low[0]}.{low[1]} only" if last == low else f"{low[0]}.{low[1]} to {last[0]}.{last[1]}"
        raise RuntimeError(
            f"lookahead.vllm supports vLLM {tested} (found {version}): "
            f"its proposer reads vLLM's model runner, which changes between versions"
        )


def calling_runner(depth: int = 2) -> tuple[Any, Any]:
    """The model runner that called the proposer, and the step's scheduler output (from the caller's frame)."""
    frame = sys._getframe(depth)
    runner, scheduler_output = frame.f_locals.get("self"), frame.f_locals.get("scheduler_output")
    if runner is None or scheduler_output is None or not hasattr(runner, "input_batch"):
        raise RuntimeError(
            "lookahead.vllm's proposer must be called by vLLM's model runner (propose_draft_token_ids); "
            f"it was called from {frame.f_code.co_name}"
        )
    return runner, scheduler_output


def read_batch(runner: Any, scheduler_output: Any, sampled: Sequence[Sequence[int]]) -> Batch:
    """The running requests as the step just run left them, in the runner's row order."""
    batch = runner.input_batch
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    rows = []
    for index, request in enumerate(batch.req_ids):
        state = runner.requests[request]
        count = int(batch.num_tokens_no_spec[index])
        prompt = state.prompt_token_ids or []
        params = state.sampling_params
        most = params.max_tokens if params is not None and params.max_tokens is not None else runner.max_model_len
        extra = (params.extra_args if params is not None else None) or {}
        stops = set(params.stop_token_ids or ()) if params is not None else set()
        if params is not None and not params.ignore_eos and params.eos_token_id is not None:
            stops.add(params.eos_token_id)
        rows.append(
            Row(
                request=request,
                prompt=prompt,
                tail=batch.token_ids_cpu[index, max(count - TAIL, 0) : count].tolist(),
                length=count,
                sampled=sampled[index] if index < len(sampled) else (),
                verified=len(spec_tokens.get(request, ())),
                room=min(most - (count - len(prompt)), runner.max_model_len - count),
                drafting=extra.get(OPT_OUT, True) is not False,
                stops=frozenset(stops),
            )
        )
    finished = tuple(scheduler_output.finished_req_ids)
    return Batch(rows, finished, dict(scheduler_output.num_scheduled_tokens), live=runner.requests.keys())
