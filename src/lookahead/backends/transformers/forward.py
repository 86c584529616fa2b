"""The one call into the model: a block of tokens after the cached ones, with the mask its draft needs.

Everything else in decoding reaches the model through a `ModelForward`, so how transformers
wants to be called (the cache keyword, `logits_to_keep`) is settled here once, at start.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel

from ...decoding.sampling import first_largest
from ...drafting.tree import DraftTree
from .attention import NODEWISE_SDPA, PACKED_SDPA, attention_as, grouped_attention
from .decoder import DirectDecoder
from .kvcache import new_cache
from .linears import PackedLinears, packed_as
from .masks import block_inputs, packed_inputs
from .slab import SlabCache


class ModelForward:
    """Forward passes of one unmodified transformers causal LM; one at a time, from any thread."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        accepted = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in accepted
        # transformers renamed `past_key_values` to `cache` during 5.x; an unknown name is silently ignored
        self._cache_keyword = "cache" if "cache" in accepted else "past_key_values"
        self._lock = threading.Lock()
        self.attention = grouped_attention(model, self.device)
        """The attention this engine's passes use instead of the model's SDPA (decoding/attention.py), or None."""
        self.linears: PackedLinears | None = None
        """The packed linear layers this engine's passes use instead of the model's (linears.py), or None."""
        self.packed_from = 1
        """Passes of fewer tokens run the model's own layers instead (measured faster there: kernels.packed_from)."""
        self.nodewise = False
        """Verification passes attend token by token, as one-token steps would (attention.py: NODEWISE_SDPA; a
        packed batch's `Packing.token_reads`); set where that makes a low-precision model's drafts round as plain
        decoding does (capability.settle_rounding)."""
        self.most_rows: int | None = None
        """Most rows a packed product of a verification pass takes, more made in pieces (linears.packed_as): where
        wider products round a row otherwise (capability.settle_rounding); None: any."""
        self.one_call = True
        """A packed pass may attend every row's block in one padded call where that is cheaper (masks.packed_inputs);
        False: drafts always in calls of their own (the start-up probes check both ways)."""
        self.groups_as_heads = self.attention is not None
        """A batch's blocks of several queries attend each group of query heads as one head (attention._torch_sdpa):
        where the model has groups and our attention reads them in place, unless measured slower
        (kernels.groups_as_heads). False for any other model: its passes attend head by head, and price one padded
        call as such (masks.ONE_CALL_KEYS)."""
        self.decoder: DirectDecoder | None = None
        """The model's layers run as one loop (decoder.py), where found to give its logits bit for bit
        (capability.check_direct_decoder); None: through the model's forward."""

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self) -> Cache:
        return new_cache(self.model)

    def __call__(
        self, cache: Cache, block: Sequence[int], past: int, tree: DraftTree | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """Logits (len(block), vocab) of one sequence's `block` after `past` cached tokens (or of its last)."""
        return self.rows(cache, [block], [tree], [past], tree_masks=True, last_only=last_only)[0]

    def rows(
        self,
        cache: Cache,
        blocks: Sequence[Sequence[int]],
        trees: Sequence[DraftTree | None],
        lengths: Sequence[int],
        tree_masks: bool,
        last_only: bool = False,
        greedy: bool = False,
    ) -> Sequence[torch.Tensor]:
        """Per row, the logits (width, vocab) of its block after its `lengths[b]` cached tokens; with `greedy`, each
        position's first largest logit's index instead (int64, width), which the direct decoder may find without
        making every logit (decoder.DirectDecoder: argmax_head).

        On a slab (decoding/slab.py) the rows' blocks are packed (masks.packed_inputs), else
        padded to the widest (masks.block_inputs; the rows of one (rows, width, vocab) tensor).
        """
        if isinstance(cache, SlabCache):
            return self._packed(cache, blocks, trees, lengths, greedy)
        ids, mask, positions = block_inputs(blocks, trees, lengths, tree_masks, self.model.dtype, self.device)
        attention = self.attention
        if self.nodewise and any(tree is not None for tree in trees):  # one-token steps too: the same calls
            if len(blocks) > 1:
                raise ValueError("rows padded into one pass cannot attend token by token: verify them packed")
            if not trees[0].is_chain:
                raise ValueError("drafts verified token by token must be chains")
            attention = NODEWISE_SDPA
        linears, most_rows = self._linears(ids.numel()), self._most_rows(trees)
        with self._lock, attention_as(self.model, attention, self.groups_as_heads), packed_as(linears, most_rows):
            logits = self._logits(ids, mask, positions, cache, last_only, linears, most_rows, greedy)
        return logits[:, -1:] if last_only else logits

    def _packed(
        self,
        cache: SlabCache,
        blocks: Sequence[Sequence[int]],
        trees: Sequence[DraftTree | None],
        lengths: Sequence[int],
        greedy: bool,
    ) -> list[torch.Tensor]:
        cache.reserve([len(block) for block in blocks])
        ids, positions, packing = packed_inputs(
            blocks, trees, lengths, self.model.dtype, self.device, cache.window, cache.sliding_layers, self.nodewise,
            one_call=self.one_call, groups_as_heads=self.groups_as_heads,
        )  # fmt: skip
        mask = packing.root_mask  # what the model's mask preparation passes through; attention reads the packing
        cache.packing = packing
        try:
            linears, most_rows = self._linears(ids.numel()), self._most_rows(trees)
            with self._lock, attention_as(self.model, PACKED_SDPA, self.groups_as_heads), packed_as(linears, most_rows):
                logits = self._logits(
                    ids, mask, positions, cache, False, linears, most_rows, greedy, lookahead_packing=packing
                )[0]
        finally:
            cache.packing = None
        return list(logits.split([len(block) for block in blocks]))

    def _logits(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor,
        cache: Cache,
        last_only: bool,
        linears: PackedLinears | None,
        most_rows: int | None,
        greedy: bool,
        **attention_kwargs,
    ) -> torch.Tensor:
        """The model's logits of a block (or with `greedy` their first largest's indices): through the direct decoder
        where it was found to give the same bits, else through the model's forward (whose linear layers `packed_as`
        has routed already)."""
        if self.decoder is not None:
            return self.decoder(ids, mask, positions, cache, last_only, linears, most_rows, greedy, **attention_kwargs)
        kwargs: dict = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True}
        kwargs[self._cache_keyword] = cache
        if last_only and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        logits = self.model(**kwargs, **attention_kwargs).logits
        return first_largest(logits) if greedy else logits

    def _most_rows(self, trees: Sequence[DraftTree | None]) -> int | None:
        """`most_rows` for a verification pass (some row has a tree); None for a prompt's, which reads the same
        pieces alone or in a batch (ModelVerifier.prefill) and so rounds the same either way."""
        return self.most_rows if any(tree is not None for tree in trees) else None

    def _linears(self, tokens: int) -> PackedLinears | None:
        """The packed layers for a pass of `tokens` (every row's, padding included), or None for the model's own."""
        return self.linears if tokens >= self.packed_from else None
