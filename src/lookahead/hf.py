"""transformers integration: `model.generate(**inputs, custom_generate=lookahead.hf.generate)`.

transformers 5 prepares the generation config, the logits processors (repetition penalty,
temperature, top-k/p, ...) and the stopping rules, then hands the decoding loop to this
callable; we run it through a LookaheadEngine kept per model, so its trie learns across calls.
transformers does not pass `streamer=` on to a custom callable: bind it with
`custom_generate=lookahead.hf.streaming(streamer)` instead. Left-padded batches are decoded
together (LookaheadEngine.generate_batch), each row as it would be alone.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .decoding.transcript import eos_ids
from .engine import LookaheadEngine

_ENGINES: weakref.WeakKeyDictionary[PreTrainedModel, LookaheadEngine] = weakref.WeakKeyDictionary()


def engine_for(model: PreTrainedModel) -> LookaheadEngine:
    """The engine (and trie) that `generate` uses for `model`; created on first use."""
    if model not in _ENGINES:
        _ENGINES[model] = LookaheadEngine(model, None)
    return _ENGINES[model]


def forget(model: PreTrainedModel) -> None:
    """Drop the engine kept for `model`, and what its trie learned: the next `generate` starts afresh."""
    _ENGINES.pop(model, None)


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop of `generate()`, with lookahead drafts; a left-padded batch is decoded as one batch.

    Returns what `generate` returns: prompts and new tokens (rows that end early padded with
    the pad token), or a GenerateDecoderOnlyOutput with `sequences` when
    `return_dict_in_generate` is set (scores and caches are not kept).
    """
    prompts = _unpadded(input_ids, model_kwargs.get("attention_mask"))
    if streamer is not None and len(prompts) > 1:
        raise ValueError("a streamer takes one sequence: stream batches row by row")
    known = (MaxLengthCriteria, EosTokenCriteria)  # both are applied through max_length and eos_token_id
    if unsupported := [type(c).__name__ for c in stopping_criteria if not isinstance(c, known)]:
        raise ValueError(f"stopping criteria not supported with lookahead: {', '.join(unsupported)}")
    do_sample = bool(generation_config.do_sample)
    # from torch's global generator, so torch.manual_seed() reproduces; greedy leaves it untouched, as generate() does
    seeds = [int(torch.randint(2**62, (1,))) for _ in prompts] if do_sample else None
    engine = engine_for(model)
    stop_ids = sorted(eos_ids(generation_config))
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    if streamer is not None:
        streamer.put(input_ids.cpu())  # as generate() does: streamers print or skip the prompt
        on_tokens = lambda tokens: streamer.put(torch.tensor(tokens))  # noqa: E731
        out = engine.generate(
            prompts[0], max_new_tokens, do_sample=do_sample, seed=seeds and seeds[0], stop_token_ids=stop_ids,
            logits_processor=logits_processor, on_tokens=on_tokens,
        )  # fmt: skip
        streamer.end()
        new = [out.token_ids]
    else:
        outs = engine.generate_batch(
            prompts, max_new_tokens, max_batch=len(prompts), progress=False, do_sample=do_sample, seed=seeds,
            stop_token_ids=stop_ids, logits_processor=logits_processor,
        )  # fmt: skip
        new = [out.token_ids for out in outs]
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (stop_ids or [0])[0]  # what generate() falls back to
    longest = max(map(len, new))
    tail = torch.tensor([tokens + [pad] * (longest - len(tokens)) for tokens in new], dtype=torch.long)
    sequences = torch.cat([input_ids, tail.to(input_ids.device)], dim=1)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _unpadded(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's prompt without its left padding; refuses padding anywhere else."""
    rows = input_ids.tolist()
    if mask is None:
        return rows
    prompts = []
    for ids, keep in zip(rows, mask.tolist(), strict=True):
        start = keep.index(1) if 1 in keep else len(keep)
        if start == len(keep) or not all(keep[start:]):
            raise ValueError(
                "lookahead needs left-padded inputs (attention_mask zeros first, then ones, and at least one "
                "token a row), as generate() does for decoder-only models"
            )
        prompts.append(ids[start:])
    return prompts


def streaming(streamer) -> Callable[..., torch.LongTensor | GenerateDecoderOnlyOutput]:
    """`generate` bound to a transformers streamer (TextStreamer, TextIteratorStreamer, ...)."""
    return functools.partial(generate, streamer=streamer)
