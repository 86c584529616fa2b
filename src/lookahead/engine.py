"""LookaheadEngine: the public face of decoding — generate, stream, chat — over one model and one trie.

The engine checks each request, builds its Generation and runs the step loop
(decoding/step.py) through its backend's verifier (decoding/backend.py: transformers or
llama.cpp); drafts come from the trie drafter (drafting/drafter.py). With
`use_lookahead=False` the same loop runs without a drafter, which is plain greedy decoding
(the baseline of every speedup).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from transformers import LogitsProcessorList, PreTrainedTokenizerBase

from .config import LookaheadConfig
from .decoding.backend import Backend, DraftMode
from .decoding.batch import Batch, decode
from .decoding.costs import cost_model
from .decoding.generation import Generation, GenerationOutput
from .decoding.sampling import SamplingParams, TokenChooser
from .decoding.step import Verifier
from .decoding.transcript import Transcript, stop_strings
from .drafting.drafter import TrieDrafting
from .drafting.policy import DraftPolicy
from .drafting.trie import TokenTrie

PREFILL_CHUNK = 256
"""Prompt tokens read per round while other generations run (a 256-token read is a few steps' time on a CPU)."""


def backend_for(model: Any, tokenizer: PreTrainedTokenizerBase | None, config: LookaheadConfig) -> Backend:
    """The backend of the model's runtime: llama.cpp for a model that says so (load_model's), else transformers."""
    if getattr(model, "runtime", None) == "llama.cpp":
        from .backends.llamacpp.backend import LlamaCppBackend

        return LlamaCppBackend(model, config)
    from .backends.transformers.backend import TransformersBackend

    return TransformersBackend(model, tokenizer, config)


class TextStream:
    """Text deltas of one generation as its tokens are accepted; `.output` once it is exhausted."""

    def __init__(self, steps: Iterator[list[int]], generation: Generation) -> None:
        self.output: GenerationOutput | None = None
        self._generation = generation
        self._deltas = self._run(steps, generation)

    @property
    def tokens(self) -> list[int]:
        """The new tokens kept so far."""
        return self._generation.transcript.tokens

    @property
    def sources(self) -> list[int]:
        """Per kept token, its draft's source flags (0: the model's own; sourceview.py names them)."""
        return self._generation.sources

    @property
    def steps(self) -> int:
        """Forward passes after the prompt so far."""
        return self._generation.stats.steps

    def _run(self, steps: Iterator[list[int]], generation: Generation) -> Iterator[str]:
        for _ in steps:
            if piece := generation.transcript.delta():
                yield piece
        self.output = generation.output()

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def close(self) -> None:
        """End the generation now (its engine is free for the next request)."""
        self._deltas.close()


class LookaheadEngine:
    """Lossless lookahead decoding for a model you already have: an unmodified transformers causal LM, or a GGUF
    model on llama.cpp (load_model(..., backend="llama.cpp")).

    One forward pass runs at a time, so several threads may share an engine and its trie.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase | None,
        config: LookaheadConfig | None = None,
        trie: TokenTrie | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        config = config or LookaheadConfig()
        if trie is not None and (kept := trie.recycled.k if trie.recycled is not None else 0) != config.recycled:
            warnings.warn(
                f"the trie {'keeps' if kept else 'keeps no'} recycled drafts"
                f"{f' ({kept} tokens a token)' if kept else ''}: the engine follows it, not "
                f"LookaheadConfig.recycled={config.recycled}",
                stacklevel=2,
            )
            config = replace(config, recycled=kept)
        self.backend = backend = backend_for(model, tokenizer, config)
        if backend.max_draft < config.decoding_length:  # the runtime verifies no wider block exactly
            config = replace(config, decoding_length=backend.max_draft)
        self.config = config
        self.eos_ids = backend.eos_ids
        trie = trie if trie is not None else TokenTrie.from_config(config, self.eos_ids)
        if tokenizer is not None:
            trie.bind_tokenizer(tokenizer)  # a trie saved with another tokenizer is refused here
        trie.check_vocabulary(backend.vocab_size)  # and one with ids the model has no embedding for
        adaptive = config.policy == "adaptive" and self.draft_mode != "off"
        cost = cost_model(backend.meter()) if adaptive else None
        self.drafting = TrieDrafting.from_config(config, self.eos_ids, cost, trie)
        self._batching_lock = threading.Lock()
        self._batching_priced = False
        self.verifier: Verifier = backend.verifier
        """What the step verifies drafts with: the backend's (replaceable, e.g. to price steps by a cost model)."""

    @property
    def trie(self) -> TokenTrie:
        """The shared trie every request drafts from and teaches."""
        return self.drafting.trie

    @property
    def policy(self) -> DraftPolicy:
        """The engine-wide cost model and acceptance rates."""
        return self.drafting.policy

    @property
    def draft_mode(self) -> DraftMode:
        """What the backend verifies exactly now: trees, single paths (a batching llama.cpp engine's) or nothing."""
        return self.backend.draft_mode

    @property
    def max_positions(self) -> int | None:
        """Most tokens a request may hold on the backend as it runs now (a batching engine's may be fewer)."""
        return self.backend.max_positions

    @property
    def tree_mode(self) -> bool:
        """True when multi-branch drafts are verified; else single-path drafts (or none)."""
        return self.draft_mode == "tree"

    # ---- public API ------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of `prompt` (text is tokenized as is; ids are checked against the vocabulary)."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer: this engine has none, pass token ids")
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.backend.vocab_size
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
        repetition_penalty, presence_penalty and frequency_penalty (OpenAI's, over the answer),
        logit_bias ({token id: bias}), seed (same seed, same output, with or without lookahead;
        any integer in [-2**63, 2**64), a negative one taken modulo 2**64), stop (a string or
        list: the text ends before the first), stop_token_ids, logits_processor (a transformers
        LogitsProcessorList used instead of the sampling settings), logprobs (k: each new
        token's log-probability under the model and its k likeliest alternatives, in
        `GenerationOutput.logprobs`), on_tokens (called with each step's new tokens).
        """
        generation = self.prepare(prompt, max_new_tokens, **options)
        for _ in self._steps(generation, use_lookahead):
            pass
        return generation.output()

    def stream(
        self, prompt: str | Sequence[int], max_new_tokens: int = 128, use_lookahead: bool = True, **options
    ) -> TextStream:
        """Text deltas as tokens are accepted (same options as `generate`); never half a character.

        The arguments are checked here, before the first step. Closing the stream early ends
        the generation; once it is exhausted, `.output` holds what `generate` would return.
        """
        generation = self.prepare(prompt, max_new_tokens, **options)
        return TextStream(self._steps(generation, use_lookahead), generation)

    def chat(
        self, messages: list[dict[str, str]], max_new_tokens: int = 128, use_lookahead: bool = True, **options
    ) -> GenerationOutput:
        """The assistant's reply to `messages` in the tokenizer's chat template (options as `generate`)."""
        return self.generate(self.chat_ids(messages), max_new_tokens, use_lookahead, **options)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int | list[int] = 128,
        max_batch: int = 8,
        use_lookahead: bool = True,
        progress: bool | None = None,
        **options,
    ) -> list[GenerationOutput]:
        """`generate` for many prompts, decoded together: outputs in input order, each what it would be alone.

        Up to `max_batch` generations run at once, verified in one forward pass a step; a
        finished one makes room for the next at once. Any option (and `max_new_tokens`) may be
        a list with one value per prompt — for `stop` and `stop_token_ids`, whose own values
        are lists, a list of lists. `progress`: a progress bar on stderr (default: when stderr
        is a terminal).
        """
        prompts = list(prompts)
        _check_max_batch(max_batch)
        rows = _per_prompt(len(prompts), {"max_new_tokens": max_new_tokens, **options})
        batch = self.batch(max(1, min(max_batch, len(prompts))), use_lookahead, closed=True)  # may change the limits
        generations = [self.prepare(prompt, **row) for prompt, row in zip(prompts, rows, strict=True)]
        for generation in generations:
            batch.add(generation)
        show = sys.stderr.isatty() if progress is None else progress
        with _progress(show, len(generations)) as advance:
            try:
                while batch:
                    advance(sum(generation.done for generation, _ in batch.step()))
            finally:
                batch.close()
        return [generation.output() for generation in generations]

    # ---- requests ----------------------------------------------------------------------------

    def batch(self, max_batch: int, use_lookahead: bool = True, closed: bool = False) -> Batch:
        """A continuous batch on this engine: add prepared generations, call `step()` until it is empty.

        The first batch of more than one row probes once whether this model verifies rows of
        different lengths together (else they are verified one at a time, with a warning) and
        measures the cost of batched steps for the adaptive policy (cached on disk). `closed`:
        every generation is added before the first step (see Batch).
        """
        _check_max_batch(max_batch)
        if max_batch > 1:
            self._enable_batching(max_batch)
        chunk = PREFILL_CHUNK if max_batch > 1 else None
        return Batch(self.verifier, self._drafting(use_lookahead), max_batch, prefill_chunk=chunk, closed=closed)

    def _drafting(self, use_lookahead: bool) -> TrieDrafting | None:
        return self.drafting if use_lookahead and self.draft_mode != "off" else None

    def _steps(self, generation: Generation, use_lookahead: bool) -> Iterator[list[int]]:
        return decode(generation, self.verifier, self._drafting(use_lookahead))

    def _enable_batching(self, max_batch: int) -> None:
        """Let the backend verify up to `max_batch` rows together (probing how, where it must), and, once, price
        batched steps.

        Steps of more rows than the first batch's `max_batch` are priced by extrapolation.
        """
        with self._batching_lock:
            self.policy.packed = self.backend.enable_batching(max_batch)
            if self._batching_priced:
                return
            self._batching_priced = True
            if self.backend.verifier.batched and self.policy.adaptive:
                self.policy.cost = cost_model(self.backend.meter(batched=True), max_batch)

    def prepare(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logits_processor: LogitsProcessorList | None = None,
        logprobs: int | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """A checked Generation of `prompt`, ready for the step loop (options as `generate`).

        Every argument is validated here, before any model work, so a request that waited for
        its turn cannot then fail on its input.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        ids = self.encode(prompt)
        if self.max_positions and len(ids) + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_positions} tokens"
            )
        params = SamplingParams(
            do_sample, temperature, top_k, top_p, min_p, repetition_penalty, seed,
            presence_penalty, frequency_penalty, logit_bias,
        )  # fmt: skip
        if logits_processor is not None and params != SamplingParams(do_sample, seed=seed):
            raise ValueError("pass either logits_processor or sampling settings, not both")
        vocab = self.backend.vocab_size
        if bad := [t for t in logit_bias or () if t >= vocab]:
            raise ValueError(f"logit_bias: token ids outside the vocabulary of {vocab}: {bad[:5]}")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 (alternatives per token) or None, got {logprobs!r}")
        processors = params.processors(len(ids)) if logits_processor is None else logits_processor
        stops = stop_strings(stop)
        tokenizer = self.tokenizer
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer: this engine has none")
        extra = [int(t) for t in stop_token_ids or ()]
        if bad := [t for t in extra if not 0 <= t < vocab]:
            raise ValueError(f"stop_token_ids outside the vocabulary of {vocab}: {bad[:5]}")
        decode_text = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer else (lambda ids: "")
        transcript = Transcript(decode_text, max_new_tokens, self.eos_ids | frozenset(extra), stops)
        chooser = TokenChooser(processors, params.sampled, seed, logprobs)
        return Generation(ids, max_new_tokens, transcript, chooser, on_tokens)


def _check_max_batch(max_batch: object) -> None:
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")


_LIST_VALUED = ("stop", "stop_token_ids")
"""Options whose single value may itself be a list: given per prompt, they are a list of lists."""


def _per_prompt(count: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Each prompt's options: a plain list is one value per prompt, anything else applies to all."""
    rows: list[dict[str, Any]] = [{} for _ in range(count)]
    for name, value in options.items():
        each = type(value) is list and (
            name not in _LIST_VALUED or all(item is None or isinstance(item, (list, tuple)) for item in value)
        )
        if each and len(value) != count:
            raise ValueError(f"{name}: {len(value)} values for {count} prompts (give one value, or one per prompt)")
        for number, row in enumerate(rows):
            row[name] = value[number] if each else value
    return rows


@contextlib.contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar over finished generations on stderr, or nothing; yields how to advance it."""
    if not show or total < 2:
        yield lambda finished: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("generating", total=total)
        yield lambda finished: bar.advance(task, finished)
