"""An unmodified transformers causal LM as the engine's runtime: probed once, verified through ModelVerifier."""

from __future__ import annotations

import threading
import warnings

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ...config import LookaheadConfig
from ...decoding.backend import DraftMode
from ...decoding.transcript import eos_ids
from .capability import (
    check_cached_decoding,
    check_direct_decoder,
    low_precision,
    probe_batching,
    probe_draft_mode,
    settle_rounding,
)
from .costs import ModelMeter
from .forward import ModelForward
from .kernels import DRAFT_WIDTHS, groups_as_heads, packed_candidate, packed_from
from .verifier import ModelVerifier

# Generation-config settings that change which token greedy `generate()` picks; the engine applies
# only the options passed to it, so it warns instead of silently differing from `generate()`.
_GREEDY_CHANGING = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "bad_words_ids",
                    "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                    "sequence_bias")  # fmt: skip


def _unsupported_settings(model: PreTrainedModel) -> list[str]:
    config = model.generation_config
    neutral = {"repetition_penalty": 1.0, "min_length": 0}
    return [name for name in _GREEDY_CHANGING if getattr(config, name, None) not in (None, neutral.get(name), [], {})]


class TransformersBackend:
    """The model in eval mode (dropout would make outputs random), its verifier, its probes and its costs."""

    name = "transformers"

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, config: LookaheadConfig
    ) -> None:
        model.eval()
        if unsupported := _unsupported_settings(model):
            warnings.warn(
                f"the model's generation config sets {', '.join(unsupported)}, which model.generate() applies by "
                "default; the engine applies only the options passed to it (or use lookahead.hf.generate)",
                stacklevel=3,
            )
        self.vocab_size: int = model.config.vocab_size
        self.max_positions: int | None = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = eos_ids(model.generation_config, tokenizer)
        self.forward = ModelForward(model)
        self.forward.linears = packed = packed_candidate(self.forward, config.linears)
        if config.direct_layers:
            check_direct_decoder(self.forward)
        check_cached_decoding(self.forward)
        self._tolerant_mode: DraftMode = probe_draft_mode(self.forward)
        """What the model verifies within float tolerance, before low precision asks for bits (batches' layouts are
        probed for it)."""
        routed = None  # from how many tokens packed layers win, where low precision may not route by it
        if packed is not None and config.linears == "auto":
            widths = DRAFT_WIDTHS if self._tolerant_mode != "off" else (1,)
            verdict = packed_from(self.forward, packed, widths)
            if verdict is None or (verdict > 1 and low_precision(self.forward)):
                self.forward.linears = None  # low precision: the two kinds round otherwise, so one for every width
                routed = verdict
            else:
                self.forward.packed_from = verdict
        self.draft_mode: DraftMode
        self.draft_mode, widest = settle_rounding(self.forward, self._tolerant_mode, config.decoding_length + 1)
        if routed is not None and not self.forward.nodewise:  # bits were not to be had anyway: route as measured
            self.forward.linears, self.forward.packed_from = packed, routed
        self.max_draft = widest - 1
        self.verifier = ModelVerifier(self.forward, self.draft_mode, self.max_draft, config.recycled)
        self._batching_lock = threading.Lock()
        self._batching_probed = False

    @property
    def device(self):
        return self.forward.device

    def enable_batching(self, max_batch: int) -> bool:
        """Once: probe whether rows of different lengths verify together exactly, and in which layout; where they do,
        and the model has groups of query heads, how a batch's blocks attend them fastest (kernels.groups_as_heads)."""
        with self._batching_lock:
            if not self._batching_probed:
                self._batching_probed = True
                self.verifier.layout = layout = probe_batching(self.forward, self._tolerant_mode)
                if layout is not None and self.forward.groups_as_heads and max_batch > 1:
                    self.forward.groups_as_heads = groups_as_heads(self.forward, layout, max_batch)
        return self.verifier.layout == "packed"

    def meter(self, batched: bool = False) -> ModelMeter:
        return ModelMeter(self.forward, self.verifier.layout if batched else None, self.draft_mode == "tree")
