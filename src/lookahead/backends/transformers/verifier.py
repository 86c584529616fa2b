"""Verification on the model: every row's draft packed behind its root, one forward pass, the walks, the caches kept.

This is the Verifier the engine's step runs through (decoding/step.py). The generations
passed to one `verify` call are one batch: their caches are merged into one cache the first
time they are stepped together — a slab whose rows' blocks are packed (decoding/slab.py), or
where the model cannot take that, a padded cache (decoding/kvcache.py: BatchCache) — and a
generation no longer passed leaves it. A model that cannot verify rows of different lengths
together (sliding-window layers without SDPA attention, or a failed probe) verifies them one
after another.

Work on tensors happens inside `torch.inference_mode()` entered here, per call, so nothing
is left in inference mode between steps: a caller iterating a stream keeps its own autograd.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...decoding.backend import DraftMode
from ...decoding.generation import Generation
from ...decoding.sampling import argmaxes, likeliest
from ...decoding.step import Verdict
from ...decoding.verify import accept, accept_greedy, chooser_of, node_choice
from ...drafting.tree import DraftTree
from .capability import Layout
from .forward import ModelForward
from .kvcache import BatchCache
from .slab import SlabCache

RowCache = BatchCache | SlabCache
PROMPT_PIECE = 256
"""Where a low-precision model's prompt passes start and end (multiples of it), alone or in a batch."""


class ModelVerifier:
    """Prefill and verification of generations on one model."""

    def __init__(
        self, forward: ModelForward, mode: DraftMode, max_draft: int, following: int = 0, layout: Layout | None = None
    ) -> None:
        self.forward = forward
        self.mode = mode
        self.max_draft = max_draft
        self.following = following
        """Likeliest next tokens a verdict gives per verified position (the root and each node) for a drafting
        generation (Verdict.following); 0: none."""
        self.layout = layout
        """How rows of different lengths share one forward pass (capability.probe_batching); None: they do not."""
        window = getattr(forward.config, "sliding_window", None)
        self._window = window if isinstance(window, int) and window > 0 else None
        self._caches: dict[Generation, RowCache] = {}
        """The cache each generation's rows live in (several generations share one once stepped together)."""

    @property
    def batched(self) -> bool:
        return self.layout is not None

    def max_leaves(self, generation: Generation) -> int:
        """Trees need the custom mask, which does not model sliding windows: stay inside them."""
        if self.mode != "tree":
            return 1
        inside = self._window is None or len(generation.tokens) + self.max_draft < self._window
        return self.max_draft if inside else 1

    def join(self, generation: Generation) -> None:
        """Nothing to take: the generation's cache is made at its prefill and merged at its first batched step."""

    def leave(self, generation: Generation) -> None:
        self._caches.pop(generation, None)

    def holds(self, generation: Generation) -> bool:
        """True while a cache of the generation is kept here (from its prefill until it leaves)."""
        return generation in self._caches

    def _batch(self, generations: Sequence[Generation]) -> RowCache:
        """The one cache of exactly these generations: their caches merged (a slab if packed), leavers' rows dropped."""
        first = self._caches[generations[0]]
        if first.owners == list(generations):
            return first
        caches: list[RowCache] = []
        for generation in generations:
            if not any(self._caches[generation] is cache for cache in caches):
                caches.append(self._caches[generation])
        parts = [cache.select([g for g in generations if self._caches[g] is cache]) for cache in caches]
        merged = SlabCache.merge(parts) if self.layout == "packed" else BatchCache.merge(parts)
        for generation in generations:
            self._caches[generation] = merged
        return merged

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        firsts: list[int | None] = []
        with torch.inference_mode():
            for generation, count in zip(generations, counts, strict=True):
                if count == 0:
                    firsts.append(None)
                    continue
                clock = time.perf_counter()
                kept = self._caches.get(generation)
                cache = kept.cache if kept is not None else self.forward.new_cache()
                read, prompt = generation.prefilled, generation.prompt
                for start, end in self._prompt_pieces(read, count, len(prompt)):
                    logits = self.forward(cache, prompt[start:end], start, last_only=True)[-1:]
                generation.prefilled = read = end
                self._caches[generation] = BatchCache(cache, [read], [generation])
                firsts.append(node_choice(generation, logits, prompt)(0, []) if read == len(prompt) else None)
                generation.stats.prefill_s += time.perf_counter() - clock
        return firsts

    def _prompt_pieces(self, read: int, count: int, length: int) -> list[tuple[int, int]]:
        """The passes that read `count` more of a `length`-token prompt after `read`: one, or where the model
        verifies token by token (low precision), pieces from multiples of PROMPT_PIECE to the next, the last read
        whole, so a prompt is read in the same passes alone or joining a batch (its cache has the same bits)."""
        end = min(read + count, length)
        if not self.forward.nodewise:
            return [(read, end)]
        end = min(-(-end // PROMPT_PIECE) * PROMPT_PIECE, length)  # so `read` is always a multiple, or the end
        return [(start, min(start + PROMPT_PIECE, end)) for start in range(read, end, PROMPT_PIECE)]

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        pairs = list(zip(generations, trees, strict=True))
        groups = [pairs] if self.batched else [[pair] for pair in pairs]
        verdicts: dict[int, Verdict] = {}
        milliseconds = 0.0
        with torch.inference_mode():
            for group in groups:
                milliseconds += self._verify_rows(group, verdicts)
        return [verdicts[id(generation)] for generation in generations], milliseconds

    def _verify_rows(self, pairs: list[tuple[Generation, DraftTree]], verdicts: dict[int, Verdict]) -> float:
        """One forward pass over these rows; their verdicts into `verdicts`; the milliseconds of the model's work."""
        tree_of = {id(generation): tree for generation, tree in pairs}
        batch = self._batch([generation for generation, _ in pairs])
        rows: list[Generation] = batch.owners  # the cache's row order
        trees = [tree_of[id(generation)] for generation in rows]
        for generation, length in zip(rows, batch.lengths, strict=True):
            if length != len(generation.tokens) - 1:
                raise RuntimeError("a generation's cache does not match its tokens")
        blocks = [[generation.tokens[-1], *tree.tokens] for generation, tree in zip(rows, trees, strict=True)]
        choosers = [chooser_of(generation) for generation in rows]
        greedy = all(chooser.plain_argmax for chooser in choosers) and not self.following  # no logit read but choices
        tick = time.perf_counter()
        logits = self.forward.rows(batch.cache, blocks, trees, batch.lengths, self.mode == "tree", greedy=greedy)
        tock = time.perf_counter()
        if greedy:
            argmax = [row.tolist() for row in logits]
        else:
            argmax = [argmaxes(row) for row in logits] if any(c.plain_argmax for c in choosers) else None
        kept = []
        for row, (generation, tree, chooser) in enumerate(zip(rows, trees, choosers, strict=True)):
            if chooser.plain_argmax:
                accepted, emitted = accept_greedy(tree, argmax[row])
            else:
                accepted, emitted = accept(tree, node_choice(generation, logits[row], generation.tokens))
            following = None
            if self.following and generation.drafter is not None:
                following = likeliest(logits[row][: len(tree) + 1], self.following)
            verdicts[id(generation)] = Verdict(accepted, emitted, following)
            kept.append([0, *accepted])
        tack = time.perf_counter()
        batch.keep(kept, max(map(len, blocks)))
        done = time.perf_counter()
        for generation in rows:
            stats = generation.stats
            stats.forward_s += tock - tick
            stats.verify_s += tack - tock
            stats.compact_s += done - tack
        return (tack - tick) * 1000
