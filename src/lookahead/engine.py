"""LookaheadEngine: prefill, then draft → one forward pass → verify → compact, until a stop.

The only module that calls the model. Drafts come from the TokenTrie, acceptance from
verify.py, cache surgery from kvcache.py; with `use_lookahead=False` the same loop runs
with empty drafts, which is plain greedy decoding (the baseline of every speedup).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import Cache, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from .capability import probe_draft_mode
from .config import LookaheadConfig
from .draft import DraftTree
from .kvcache import keep_accepted, new_cache
from .models import cache_dir
from .policy import CostModel, DraftPolicy, DraftSession
from .sampling import SamplingParams, TokenChooser
from .transcript import FinishReason, Transcript, stop_strings
from .trie import TokenTrie
from .verify import accept, accept_greedy

DraftMode = Literal["tree", "chain", "off"]
COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # small widths are irregular on CPUs


@dataclass
class GenerationStats:
    """Where a generation's time went and how much each forward pass earned."""

    steps: int = 0
    """Forward passes after prefill."""
    new_tokens: int = 0
    draft_tokens: int = 0
    """Draft nodes sent to the model, summed over steps."""
    accepted_histogram: Counter[int] = field(default_factory=Counter)
    """Draft tokens accepted per step (the bonus token not counted) → number of steps."""
    prefill_s: float = 0.0
    forward_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    compact_s: float = 0.0

    @property
    def edl(self) -> float:
        """Effective decoding length: new tokens per forward pass after prefill."""
        return self.new_tokens / self.steps if self.steps else float(self.new_tokens)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.forward_s + self.draft_s + self.verify_s + self.compact_s


@dataclass
class GenerationOutput:
    token_ids: list[int]
    """New tokens only, end-of-sequence included if generated."""
    text: str
    """Decoded new text, ending before a stop string if one was hit."""
    stats: GenerationStats
    finish_reason: FinishReason
    """'stop': end-of-sequence, a stop token or a stop string; 'length': max_new_tokens reached."""


class _Request:
    """One generation: its prompt, how it chooses tokens, and where it stops."""

    def __init__(
        self,
        engine: LookaheadEngine,
        prompt: list[int],
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logits_processor: LogitsProcessorList | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        params = SamplingParams(do_sample, temperature, top_k, top_p, min_p, repetition_penalty, seed)
        if logits_processor is not None and params != SamplingParams(do_sample, seed=seed):
            raise ValueError("pass either logits_processor or sampling settings, not both")
        processors = params.processors() if logits_processor is None else logits_processor
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.chooser = TokenChooser(processors, params.sampled, seed)
        self.on_tokens = on_tokens
        stops = stop_strings(stop)
        tokenizer = engine.tokenizer
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: this engine has none")
        extra = [int(t) for t in stop_token_ids or ()]
        vocab = engine.model.config.vocab_size
        if bad := [t for t in extra if not 0 <= t < vocab]:
            raise ValueError(f"stop_token_ids outside the vocabulary of {vocab}: {bad[:5]}")
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else (lambda ids: "")
        self.transcript = Transcript(decode, max_new_tokens, engine.eos_ids | frozenset(extra), stops)

    def output(self, stats: GenerationStats) -> GenerationOutput:
        transcript = self.transcript
        return GenerationOutput(list(transcript.tokens), transcript.text, stats, transcript.finish_reason or "length")


class TextStream:
    """Text deltas of one generation as its tokens are accepted; `.output` once it is exhausted."""

    def __init__(self, engine: LookaheadEngine, request: _Request, use_lookahead: bool) -> None:
        self.output: GenerationOutput | None = None
        self._deltas = self._run(engine, request, use_lookahead)

    def _run(self, engine: LookaheadEngine, request: _Request, use_lookahead: bool) -> Iterator[str]:
        stats = GenerationStats()
        for _ in engine._decode(request, use_lookahead, stats):
            if piece := request.transcript.delta():
                yield piece
        self.output = request.output(stats)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        """End the generation now (its engine is free for the next request)."""
        self._deltas.close()


# Generation-config settings that change which token greedy `generate()` picks; the engine applies
# only the options passed to it, so it warns instead of silently differing from `generate()`.
_GREEDY_CHANGING = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "bad_words_ids",
                    "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                    "sequence_bias")  # fmt: skip


def _unsupported_settings(model: PreTrainedModel) -> list[str]:
    config = model.generation_config
    neutral = {"repetition_penalty": 1.0, "min_length": 0}
    return [name for name in _GREEDY_CHANGING if getattr(config, name, None) not in (None, neutral.get(name), [], {})]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """End-of-sequence ids as `generate` sees them: the generation config first."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _node_choice(chooser: TokenChooser, logits: torch.Tensor, sequence: list[int]) -> Callable[[int, list[int]], int]:
    """The model's choice at a node of this step's block, given the draft path accepted above it."""
    return lambda node, path: chooser.choose(logits[node], sequence + path)


class LookaheadEngine:
    """Lossless lookahead decoding for an unmodified transformers causal LM.

    The model is put in eval mode (dropout would make outputs random). One forward pass runs
    at a time, so several threads may share an engine and its trie.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        config: LookaheadConfig | None = None,
        trie: TokenTrie | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or LookaheadConfig()
        self.eos_ids = _eos_ids(model, tokenizer)
        if unsupported := _unsupported_settings(model):
            warnings.warn(
                f"the model's generation config sets {', '.join(unsupported)}, which model.generate() applies by "
                "default; the engine applies only the options passed to it (or use lookahead.hf.generate)",
                stacklevel=2,
            )
        if trie is None:
            trie = TokenTrie(
                self.config.ngram_length, self.eos_ids, self.config.trie_max_nodes, self.config.trie_half_life
            )
        if tokenizer is not None:
            trie.bind_tokenizer(tokenizer)  # a trie saved with another tokenizer is refused here
        self.trie = trie
        self.device = next(model.parameters()).device
        accepted = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in accepted
        # transformers renamed `past_key_values` to `cache` during 5.x; an unknown name is silently ignored
        self._cache_keyword = "cache" if "cache" in accepted else "past_key_values"
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        window = getattr(model.config, "sliding_window", None)
        self._tree_window = window if isinstance(window, int) and window > 0 else None
        self._forward_lock = threading.Lock()
        self.draft_mode: DraftMode = probe_draft_mode(self)
        cost = self._cost_model() if self.config.policy == "adaptive" and self.draft_mode != "off" else None
        self.policy = DraftPolicy(cost)

    @property
    def tree_mode(self) -> bool:
        """True when multi-branch drafts are verified; else single-path drafts (or none)."""
        return self.draft_mode == "tree"

    # ---- the one call into the model -----------------------------------------------------

    def forward(
        self, cache: Cache, block: Sequence[int], past: int, tree: DraftTree | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits (len(block), vocab) for `block` after `past` cached tokens.

        A branching `tree` gets a 4-D additive mask and depth-based positions; a chain (or
        no draft) uses the ordinary causal mask, which every model supports.
        """
        size = len(block)
        ids = torch.tensor([list(block)], dtype=torch.long, device=self.device)
        kwargs: dict = {"input_ids": ids, self._cache_keyword: cache, "use_cache": True}
        if tree is not None and not tree.is_chain:
            kwargs["attention_mask"] = tree.attention_mask(past, self.model.dtype, self.device)
            kwargs["position_ids"] = tree.position_ids(past, self.device)
        else:
            kwargs["attention_mask"] = torch.ones((1, past + size), dtype=torch.long, device=self.device)
            kwargs["position_ids"] = torch.arange(past, past + size, device=self.device).unsqueeze(0)
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self._forward_lock:
            logits = self.model(**kwargs).logits[0]
        return logits[-1:] if last_only else logits

    def measure_cost(
        self, widths: Sequence[int] = COST_WIDTHS, context: int = 128, repeats: int = 3
    ) -> dict[int, float]:
        """Median milliseconds of a forward pass of each width after `context` cached tokens."""
        vocab = self.model.config.vocab_size
        prefix = [(100 + 7 * i) % vocab for i in range(context)]
        costs = {}
        with torch.inference_mode():
            cache = new_cache(self.model)
            self.forward(cache, prefix, 0, last_only=True)
            for width in widths:
                times = []
                for _ in range(repeats):
                    clock = time.perf_counter()
                    self.forward(cache, prefix[:width], context).argmax(-1).tolist()  # as a step: waits for the device
                    times.append((time.perf_counter() - clock) * 1000)
                    cache.crop(-width)  # the context stays the same for every measurement
                costs[width] = round(statistics.median(times), 3)
        return costs

    def _cost_model(self) -> CostModel:
        """The cost curve of this model on this device, measured once and cached on disk."""
        name = getattr(self.model.config, "_name_or_path", "")
        key = f"{name}|{self.model.dtype}|{self.device}|threads={torch.get_num_threads()}|widths={COST_WIDTHS}"
        path = cache_dir() / "costs.json"
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if name and isinstance(known.get(key), dict):
            with contextlib.suppress(ValueError):
                return CostModel(known[key])
        points = self.measure_cost()
        if name:
            known[key] = points
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                scratch = path.with_name(f".costs-{os.getpid()}.json")
                scratch.write_text(json.dumps(known, indent=1))
                scratch.replace(path)
        return CostModel(points)

    # ---- public API ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of `prompt` (text is tokenized as is; ids are checked against the vocabulary)."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: this engine has none, pass token ids")
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"token ids outside the vocabulary of {vocab}: {bad[:5]}")
        return ids

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation in the tokenizer's chat template, ready for the reply."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: pass the prompt text or ids instead")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return [int(t) for t in ids]

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int = 128, use_lookahead: bool = True, **options
    ) -> GenerationOutput:
        """The continuation of `prompt`, token for token what plain decoding gives.

        Greedy by default. `options`: do_sample, temperature (0 = greedy), top_k, top_p, min_p,
        repetition_penalty, seed (same seed, same output, with or without lookahead), stop (a
        string or list: the text ends before the first), stop_token_ids, logits_processor (a
        transformers LogitsProcessorList used instead of the sampling settings).
        """
        request = self._request(prompt, max_new_tokens, options)
        stats = GenerationStats()
        for _ in self._decode(request, use_lookahead, stats):
            pass
        return request.output(stats)

    def stream(
        self, prompt: str | Sequence[int], max_new_tokens: int = 128, use_lookahead: bool = True, **options
    ) -> TextStream:
        """Text deltas as tokens are accepted (same options as `generate`); never half a character.

        The arguments are checked here, before the first step. Closing the stream early ends
        the generation; once it is exhausted, `.output` holds what `generate` would return.
        """
        return TextStream(self, self._request(prompt, max_new_tokens, options), use_lookahead)

    def chat(
        self, messages: list[dict[str, str]], max_new_tokens: int = 128, use_lookahead: bool = True, **options
    ) -> GenerationOutput:
        """The assistant's reply to `messages` in the tokenizer's chat template (options as `generate`)."""
        return self.generate(self.chat_ids(messages), max_new_tokens, use_lookahead, **options)

    # ---- the step loop -----------------------------------------------------------------------

    def _request(self, prompt: str | Sequence[int], max_new_tokens: int, options: dict) -> _Request:
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        ids = self.encode(prompt)
        if self.max_positions and len(ids) + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_positions} tokens"
            )
        return _Request(self, ids, max_new_tokens, **options)

    def _decode(self, request: _Request, use_lookahead: bool, stats: GenerationStats) -> Iterator[list[int]]:
        session = (
            DraftSession(self.trie, self.config, request.prompt, self.policy)
            if use_lookahead and self.draft_mode != "off"
            else None
        )
        try:
            yield from self._steps(request, session, stats)
        finally:
            if session is not None:
                session.close()

    def _steps(self, request: _Request, session: DraftSession | None, stats: GenerationStats) -> Iterator[list[int]]:
        """Prefill, then draft → forward → accept → compact until the transcript is done."""
        chooser, transcript = request.chooser, request.transcript
        with torch.inference_mode():
            cache = new_cache(self.model)
            clock = time.perf_counter()
            first = chooser.choose(self.forward(cache, request.prompt, 0, last_only=True)[-1], request.prompt)
            stats.prefill_s = time.perf_counter() - clock
            sequence = [*request.prompt]
            emitted = [first]
            while True:
                kept = transcript.extend(emitted)
                sequence.extend(kept)
                stats.new_tokens += len(kept)
                if session is not None:
                    session.learn(kept)  # what a stop discarded is never learnt
                if request.on_tokens is not None:
                    request.on_tokens(kept)
                yield kept
                if transcript.done:
                    return
                past = len(sequence) - 1
                clock = time.perf_counter()
                tree = DraftTree()
                if session is not None:
                    room = request.max_new_tokens - stats.new_tokens
                    tree = session.propose(sequence, room, self._may_branch(past))
                tick = time.perf_counter()
                logits = self.forward(cache, [sequence[-1], *tree.tokens], past, tree)
                if chooser.plain_argmax:
                    accepted, emitted = accept_greedy(tree, logits.argmax(-1).tolist())
                else:
                    accepted, emitted = accept(tree, _node_choice(chooser, logits, sequence))
                tock = time.perf_counter()
                if session is not None:
                    session.verified(tree, accepted, (tock - tick) * 1000)
                tack = time.perf_counter()
                keep_accepted(cache, len(tree) + 1, accepted)
                done_at = time.perf_counter()
                stats.draft_s += tick - clock
                stats.forward_s += tock - tick
                stats.verify_s += tack - tock
                stats.compact_s += done_at - tack
                stats.steps += 1
                stats.draft_tokens += len(tree)
                stats.accepted_histogram[len(accepted)] += 1

    def _may_branch(self, past: int) -> bool:
        """Trees need the custom mask, which does not model sliding windows: stay inside them."""
        if self.draft_mode != "tree":
            return False
        window = self._tree_window
        return window is None or past + self.config.decoding_length + 1 < window
