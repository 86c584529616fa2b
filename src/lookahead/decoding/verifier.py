"""Verification on the model: each draft packed behind its root, one forward pass, the walk, the cache kept.

This is the Verifier the engine's step runs through (decoding/step.py). Work on tensors
happens inside `torch.inference_mode()` entered here, per call, so nothing is left in
inference mode between steps: a caller iterating a stream keeps its own autograd state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..drafting.tree import DraftTree
from .capability import DraftMode
from .forward import ModelForward
from .generation import Generation
from .kvcache import keep_accepted
from .sampling import TokenChooser
from .step import Verdict
from .verify import accept, accept_greedy


def _node_choice(chooser: TokenChooser, logits: torch.Tensor, tokens: list[int]) -> Callable[[int, list[int]], int]:
    """The model's choice at a node of this step's block, given the draft path accepted above it."""
    return lambda node, path: chooser.choose(logits[node], tokens + path)


class ModelVerifier:
    """Prefill and verification of generations on one model, each generation with its own cache.

    Generations are verified one after another; a batched forward replaces the loop in `verify`
    without changing its callers.
    """

    def __init__(self, forward: ModelForward, mode: DraftMode, max_draft: int) -> None:
        self.forward = forward
        self.mode = mode
        self.max_draft = max_draft
        window = getattr(forward.config, "sliding_window", None)
        self._window = window if isinstance(window, int) and window > 0 else None

    def may_branch(self, generation: Generation) -> bool:
        """Trees need the custom mask, which does not model sliding windows: stay inside them."""
        if self.mode != "tree":
            return False
        return self._window is None or len(generation.tokens) + self.max_draft < self._window

    def prefill(self, generations: Sequence[Generation]) -> list[int]:
        firsts = []
        with torch.inference_mode():
            for generation in generations:
                clock = time.perf_counter()
                generation.cache = self.forward.new_cache()
                logits = self.forward(generation.cache, generation.prompt, 0, last_only=True)[-1]
                firsts.append(self._chooser(generation).choose(logits, generation.prompt))
                generation.stats.prefill_s += time.perf_counter() - clock
        return firsts

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        verdicts = []
        model_s = 0.0
        with torch.inference_mode():
            for generation, tree in zip(generations, trees, strict=True):
                stats, tokens, chooser = generation.stats, generation.tokens, self._chooser(generation)
                tick = time.perf_counter()
                logits = self.forward(generation.cache, [tokens[-1], *tree.tokens], len(tokens) - 1, tree)
                tock = time.perf_counter()
                if chooser.plain_argmax:
                    accepted, emitted = accept_greedy(tree, logits.argmax(-1).tolist())
                else:
                    accepted, emitted = accept(tree, _node_choice(chooser, logits, tokens))
                tack = time.perf_counter()
                keep_accepted(generation.cache, len(tree) + 1, accepted)
                stats.forward_s += tock - tick
                stats.verify_s += tack - tock
                stats.compact_s += time.perf_counter() - tack
                model_s += tack - tick
                verdicts.append(Verdict(accepted, emitted))
        return verdicts, model_s * 1000

    @staticmethod
    def _chooser(generation: Generation) -> TokenChooser:
        if generation.chooser is None:
            raise ValueError("a generation verified on the model needs a token chooser")
        return generation.chooser
