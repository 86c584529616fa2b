"""transformers integration: `model.generate(**inputs, custom_generate=lookahead.hf.generate)`.

transformers 5 prepares the generation config, the logits processors (repetition penalty,
temperature, top-k/p, ...) and the stopping rules, then hands the decoding loop to this
callable; we run it through a LookaheadEngine kept per model, so its trie learns across calls.
transformers does not pass `streamer=` on to a custom callable: bind it with
`custom_generate=lookahead.hf.streaming(streamer)` instead.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .decoding.engine import LookaheadEngine
from .models import eos_ids

_ENGINES: weakref.WeakKeyDictionary[PreTrainedModel, LookaheadEngine] = weakref.WeakKeyDictionary()


def engine_for(model: PreTrainedModel) -> LookaheadEngine:
    """The engine (and trie) that `generate` uses for `model`; created on first use."""
    if model not in _ENGINES:
        _ENGINES[model] = LookaheadEngine(model, None)
    return _ENGINES[model]


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """The decoding loop of `generate()` for one sequence, with lookahead drafts.

    Returns what `generate` returns: prompt and new tokens, or a GenerateDecoderOnlyOutput
    with `sequences` when `return_dict_in_generate` is set (scores and caches are not kept).
    """
    if input_ids.shape[0] != 1:
        raise ValueError(f"lookahead generates one sequence at a time, got a batch of {input_ids.shape[0]}")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("lookahead does not support padded inputs")
    known = (MaxLengthCriteria, EosTokenCriteria)  # both are applied through max_length and eos_token_id
    if unsupported := [type(c).__name__ for c in stopping_criteria if not isinstance(c, known)]:
        raise ValueError(f"stopping criteria not supported with lookahead: {', '.join(unsupported)}")
    prompt = input_ids[0].tolist()
    do_sample = bool(generation_config.do_sample)
    # from torch's global generator, so torch.manual_seed() reproduces; greedy leaves it untouched, as generate() does
    seed = int(torch.randint(2**62, (1,))) if do_sample else None
    engine = engine_for(model)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # as generate() does: streamers print or skip the prompt
    out = engine.generate(
        prompt,
        generation_config.max_length - len(prompt),
        do_sample=do_sample,
        seed=seed,
        stop_token_ids=sorted(eos_ids(generation_config)),
        logits_processor=logits_processor,
        on_tokens=None if streamer is None else lambda tokens: streamer.put(torch.tensor(tokens)),
    )
    if streamer is not None:
        streamer.end()
    sequences = torch.tensor([prompt + out.token_ids], dtype=torch.long, device=input_ids.device)
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def streaming(streamer) -> Callable[..., torch.LongTensor | GenerateDecoderOnlyOutput]:
    """`generate` bound to a transformers streamer (TextStreamer, TextIteratorStreamer, ...)."""
    return functools.partial(generate, streamer=streamer)
