"""Side-by-side runs: every method on every prompt, interleaved, compared with plain decoding.

Methods run per prompt in a rotating order, after a warm-up, so drift of a shared machine
spreads evenly over them. Each engine lives for the whole run, so its trie learns across
prompts as it would in a server. Every method's tokens are compared with `plain`.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..config import LookaheadConfig
from ..engine import LookaheadEngine
from .datasets import Prompt
from .divergence import first_difference, reference_margin

BUILTIN_METHODS = ("plain", "hf-greedy", "hf-prompt-lookup", "lookahead")


@dataclass
class Sample:
    """One method on one prompt."""

    dataset: str
    method: str
    key: str
    token_ids: list[int]
    seconds: float
    steps: int | None
    draft_tokens: int | None
    accepted: Counter[int] = field(default_factory=Counter)


def parse_variant(spec: str) -> tuple[str, LookaheadConfig]:
    """`NAME:key=value,key=value` → a lookahead method with those config overrides."""
    name, _, settings = spec.partition(":")
    if not name or not settings:
        raise ValueError(f"--config {spec!r}: expected NAME:key=value[,key=value]")
    try:
        return name, LookaheadConfig.parse(settings)
    except ValueError as err:
        raise ValueError(f"--config {spec!r}: {err}") from None


class Bench:
    """Holds the model, one engine per lookahead method, and runs one prompt at a time."""

    def __init__(
        self,
        model,
        tokenizer,
        methods: list[str],
        variants: dict[str, LookaheadConfig],
        max_new_tokens: int,
        sampling: dict | None = None,
    ) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or {}
        base = LookaheadEngine(model, tokenizer)
        self.engines = {"plain": base, "lookahead": base}
        self.engines.update({name: LookaheadEngine(model, tokenizer, cfg) for name, cfg in variants.items()})
        self.methods = methods
        self.chat_ids = base.chat_ids

    def run(self, method: str, prompt: Prompt, ids: list[int], max_new_tokens: int | None = None) -> Sample:
        limit = max_new_tokens or self.max_new_tokens
        if method.startswith("hf-"):
            return self._run_hf(method, prompt, ids, limit)
        engine = self.engines[method]
        # Sampling: one seed per prompt, the same for every method, so outputs stay comparable.
        options = {**self.sampling, "seed": zlib.crc32(prompt.key.encode())} if self.sampling else {}
        clock = time.perf_counter()
        out = engine.generate(ids, max_new_tokens=limit, use_lookahead=method != "plain", **options)
        seconds = time.perf_counter() - clock
        stats = out.stats
        return Sample(
            prompt.dataset, method, prompt.key, out.token_ids, seconds, stats.steps, stats.draft_tokens,
            stats.accepted_histogram,
        )  # fmt: skip

    def _run_hf(self, method: str, prompt: Prompt, ids: list[int], limit: int) -> Sample:
        inputs = torch.tensor([ids], device=self.model.device)
        extra = {"prompt_lookup_num_tokens": 10} if method == "hf-prompt-lookup" else {}
        pad = self.model.generation_config.pad_token_id
        clock = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                do_sample=False,
                max_new_tokens=limit,
                pad_token_id=pad if pad is not None else 0,
                **extra,
            )
        tokens = out[0, len(ids) :].tolist()  # waits for the device, so the clock sees all the work
        seconds = time.perf_counter() - clock
        return Sample(prompt.dataset, method, prompt.key, tokens, seconds, None, None)

    def warm_up(self, prompt: Prompt) -> None:
        """First calls pay one-off costs (allocations, kernel selection): not part of any figure.

        On an accelerator kernels are chosen per shape as the context grows, so the warm-up runs
        the full length there; on a CPU a few tokens suffice.
        """
        ids = self.chat_ids([{"role": "user", "content": prompt.text}])
        device = getattr(self.model, "device", None)
        length = self.max_new_tokens if isinstance(device, torch.device) and device.type != "cpu" else 4
        for method in self.methods:
            if method.startswith("hf-"):
                self.run(method, prompt, ids, max_new_tokens=length)
            else:
                self.engines[method].generate(ids, max_new_tokens=length, use_lookahead=False)

    def divergences(self, samples: list[Sample], prompts: list[Prompt]) -> list[dict]:
        """Every output that differs from plain decoding's: where, and (greedy) plain's top-2 margin there."""
        plain = {(s.dataset, s.key): s.token_ids for s in samples if s.method == "plain"}
        texts = {(p.dataset, p.key): p.text for p in prompts}
        found = []
        for sample in samples:
            want = plain.get((sample.dataset, sample.key))
            if sample.method == "plain" or want is None or (index := first_difference(sample.token_ids, want)) is None:
                continue
            margin = None
            if not self.sampling and index < len(want):
                ids = self.chat_ids([{"role": "user", "content": texts[sample.dataset, sample.key]}])
                margin = reference_margin(self.model, ids, want, index)
            found.append({"dataset": sample.dataset, "prompt": sample.key, "method": sample.method,
                          "position": index, "reference_margin": margin})  # fmt: skip
        return found

    def prompt(self, index: int, prompt: Prompt) -> list[Sample]:
        """All methods on one prompt, starting from a different method each time."""
        ids = self.chat_ids([{"role": "user", "content": prompt.text}])
        shift = index % len(self.methods)
        order = self.methods[shift:] + self.methods[:shift]
        return [self.run(method, prompt, ids) for method in order]


def summarize(samples: list[Sample], methods: list[str]) -> list[dict]:
    """One row per (data set, method), plus an `all` row per method; ratios against `plain`."""
    plain = {(s.dataset, s.key): s for s in samples if s.method == "plain"}
    datasets = list(dict.fromkeys(s.dataset for s in samples))
    rows = []
    for dataset in [*datasets, "all"]:
        base = [s for s in plain.values() if dataset in ("all", s.dataset)]
        base_seconds = sum(s.seconds for s in base)
        for method in methods:
            group = [s for s in samples if s.method == method and dataset in ("all", s.dataset)]
            if not group:
                continue
            new_tokens = sum(len(s.token_ids) for s in group)
            seconds = sum(s.seconds for s in group)
            steps = [s.steps for s in group if s.steps is not None]
            rows.append(
                {
                    "dataset": dataset,
                    "method": method,
                    "prompts": len(group),
                    "new_tokens": new_tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(new_tokens / seconds, 2),
                    "edl": round(new_tokens / sum(steps), 3) if steps and sum(steps) else None,
                    "draft_tokens_per_step": (
                        round(sum(s.draft_tokens or 0 for s in group) / sum(steps), 2) if steps and sum(steps) else None
                    ),
                    "speedup": round(base_seconds / seconds, 3) if base_seconds else None,
                    "exact_match": round(
                        sum(
                            (s.dataset, s.key) in plain and s.token_ids == plain[(s.dataset, s.key)].token_ids
                            for s in group
                        )
                        / len(group),
                        3,
                    ),
                }
            )
    return rows
