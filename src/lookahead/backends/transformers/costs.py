"""Timing a transformers model's forward passes for its cost curves (decoding/costs.py caches and reads them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ...drafting.tree import DraftTree
from .capability import Layout
from .forward import ModelForward
from .kvcache import BatchCache
from .slab import SlabCache


def runtime_key(forward: ModelForward) -> str:
    """What a pass's time depends on besides the linear layers (model, dtype, device, threads, attention, the
    direct decoder); '' for a model without a name."""
    name = getattr(forward.config, "_name_or_path", "")
    key = f"{name}|{forward.model.dtype}|{forward.device}|threads={torch.get_num_threads()}"
    if forward.attention is not None:  # another attention function, other costs
        key += f"|attention={forward.attention}"
    if forward.decoder is not None:  # the layers as one loop: less time around the arithmetic
        key += "|layers=direct-joined" if forward.linears is not None else "|layers=direct"
        if forward.linears is not None and forward.decoder.loop is not None:  # the layers in one compiled call
            key += "-compiled"
    return key if name else ""


class ModelMeter:
    """Passes of one model as the engine runs them: one row, or rows of a batch in `layout`."""

    def __init__(self, forward: ModelForward, layout: Layout | None = None, tree_masks: bool = True) -> None:
        self.forward = forward
        self.layout = layout
        self.tree_masks = tree_masks
        key = runtime_key(forward)
        if key and forward.linears is not None:
            kind = forward.linears.kind
            key += f"|linears={kind}" if forward.packed_from == 1 else f"|linears={kind}-from-{forward.packed_from}"
        if key and forward.nodewise:
            key += f"|chains=nodewise|rows<={forward.most_rows}"
        self.key = key
        # packed passes' drafts may attend in one call with the roots (since 2026-12-06), and a batch's blocks attend
        # a group of query heads as one (attention._torch_sdpa, since 2026-12-07) where that was measured faster
        grouping = "|queries-by-group" if forward.groups_as_heads else "|queries-by-head"
        self.batch_key = ("|packed-one-call" if layout == "packed" else "") + grouping
        self.max_positions = getattr(forward.config, "max_position_embeddings", None)

    @contextlib.contextmanager
    def passes(self, rows: int, context: int) -> Iterator[Callable[[int], None]]:
        forward, tree_masks, packed = self.forward, self.tree_masks, self.layout == "packed"
        vocab = forward.vocab_size
        prefix = _tokens(context, vocab)
        with torch.inference_mode():
            cache = forward.new_cache()
            forward.rows(cache, [prefix] * rows, [None] * rows, [0] * rows, tree_masks, last_only=True)
            if packed:  # a slab's rows keep their length: a block is written after them and never kept
                cache = SlabCache.merge([BatchCache(cache, [context] * rows, list(range(rows)))])

            def run(width: int) -> None:
                block = _tokens(width, vocab)  # as wide as asked, whatever the context's length
                draft = DraftTree.chain(block[1:])  # as drafts run (node by node, where they do)
                choices = forward.rows(cache, [block] * rows, [draft] * rows, [context] * rows, tree_masks, greedy=True)
                [row.tolist() for row in choices]  # as a greedy step: waits for the device
                if not packed:
                    cache.crop(-width)  # the context stays the same for every measurement

            yield run


def _tokens(count: int, vocab: int) -> list[int]:
    """`count` token ids spread over the vocabulary: a context or a block to time."""
    return [(100 + 7 * i) % vocab for i in range(count)]
