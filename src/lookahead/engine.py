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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from .capability import probe_draft_mode
from .config import LookaheadConfig
from .draft import DraftTree
from .kvcache import keep_accepted, new_cache
from .models import cache_dir
from .policy import CostModel, DraftPolicy, DraftSession
from .trie import TokenTrie
from .verify import accept_greedy

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
    stats: GenerationStats
    finish_reason: Literal["stop", "length"]


# Generation-config settings that change which token greedy `generate()` picks; the engine's
# greedy argmax does not apply them (yet), so it warns instead of silently differing.
_GREEDY_CHANGING = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "bad_words_ids",
                    "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                    "sequence_bias")  # fmt: skip


def _unsupported_settings(model: PreTrainedModel) -> list[str]:
    config = model.generation_config
    neutral = {"repetition_penalty": 1.0, "min_length": 0}
    return [name for name in _GREEDY_CHANGING if getattr(config, name, None) not in (None, neutral.get(name), [], {})]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids as `generate` sees them: the generation config first."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class LookaheadEngine:
    """Lossless lookahead decoding for an unmodified transformers causal LM.

    The model is put in eval mode (dropout would make outputs random). One forward pass runs
    at a time, so several threads may share an engine and its trie.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: LookaheadConfig | None = None,
        trie: TokenTrie | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or LookaheadConfig()
        self.eos_ids = _eos_ids(model, tokenizer)
        if unsupported := _unsupported_settings(model):
            warnings.warn(
                f"the model's generation config sets {', '.join(unsupported)}, which model.generate() applies "
                "and this engine does not yet: outputs may differ from generate()",
                stacklevel=2,
            )
        self.trie = trie or TokenTrie(self.config.ngram_length, boundary_ids=self.eos_ids)
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
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"token ids outside the vocabulary of {vocab}: {bad[:5]}")
        return ids

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation in the tokenizer's chat template, ready for the reply."""
        if not self.tokenizer.chat_template:
            raise ValueError("this tokenizer has no chat template: pass the prompt text or ids instead")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        return [int(t) for t in ids]

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int = 128, use_lookahead: bool = True
    ) -> GenerationOutput:
        """Greedy continuation of `prompt`, token-for-token what plain greedy decoding gives."""
        stats = GenerationStats()
        tokens: list[int] = []
        finish: list[str] = []
        for chunk in self._decode(self.encode(prompt), max_new_tokens, use_lookahead, stats, finish):
            tokens.extend(chunk)
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationOutput(tokens, text, stats, finish[0])  # type: ignore[arg-type]

    def stream(
        self, prompt: str | Sequence[int], max_new_tokens: int = 128, use_lookahead: bool = True
    ) -> Iterator[str]:
        """Text deltas as tokens are accepted; never a character cut in half."""
        tokens: list[int] = []
        printed = ""
        for chunk in self._decode(self.encode(prompt), max_new_tokens, use_lookahead, GenerationStats(), []):
            tokens.extend(chunk)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > len(printed):
                yield text[len(printed) :]
                printed = text
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > len(printed):
            yield text[len(printed) :]

    # ---- the step loop -----------------------------------------------------------------------

    def _decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        use_lookahead: bool,
        stats: GenerationStats,
        finish: list[str],
    ) -> Iterator[list[int]]:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if self.max_positions and len(prompt) + max_new_tokens > self.max_positions:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_positions} tokens"
            )
        session = (
            DraftSession(self.trie, self.config, prompt, self.policy)
            if use_lookahead and self.draft_mode != "off"
            else None
        )
        try:
            yield from self._steps(prompt, max_new_tokens, session, stats, finish)
        finally:
            if session is not None:
                session.close()

    def _steps(
        self,
        prompt: list[int],
        max_new_tokens: int,
        session: DraftSession | None,
        stats: GenerationStats,
        finish: list[str],
    ) -> Iterator[list[int]]:
        with torch.inference_mode():
            cache = new_cache(self.model)
            clock = time.perf_counter()
            first = int(self.forward(cache, prompt, 0, last_only=True).argmax(-1)[-1])
            stats.prefill_s = time.perf_counter() - clock
            sequence = [*prompt, first]
            emitted = [first]
            while True:
                emitted, done = self._cut(emitted, max_new_tokens - stats.new_tokens, finish)
                stats.new_tokens += len(emitted)
                if session is not None:
                    session.learn(emitted)
                yield emitted
                if done:
                    return
                past = len(sequence) - 1
                clock = time.perf_counter()
                tree = DraftTree()
                if session is not None:
                    tree = session.propose(sequence, max_new_tokens - stats.new_tokens, self._may_branch(past))
                tick = time.perf_counter()
                logits = self.forward(cache, [sequence[-1], *tree.tokens], past, tree)
                choices = logits.argmax(-1).tolist()
                tock = time.perf_counter()
                accepted, emitted = accept_greedy(tree, choices)
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
                sequence.extend(emitted)

    def _may_branch(self, past: int) -> bool:
        """Trees need the custom mask, which does not model sliding windows: stay inside them."""
        if self.draft_mode != "tree":
            return False
        window = self._tree_window
        return window is None or past + self.config.decoding_length + 1 < window

    def _cut(self, tokens: list[int], room: int, finish: list[str]) -> tuple[list[int], bool]:
        """Tokens up to and including the first end-of-sequence, within the token limit."""
        for i, token in enumerate(tokens[:room]):
            if token in self.eos_ids:
                finish.append("stop")
                return tokens[: i + 1], True
        if len(tokens) >= room:
            finish.append("length")
            return tokens[:room], True
        return tokens, False
