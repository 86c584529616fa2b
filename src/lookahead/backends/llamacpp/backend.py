"""A GGUF model on llama.cpp as the engine's runtime: its verifier, its limits, its passes timed for the cost curves."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator

import numpy as np

from ...config import LookaheadConfig
from ...decoding.backend import DraftMode
from ...decoding.costs import measured_rows
from .model import BATCH_TOKENS, LlamaCppModel
from .verifier import Entry, LlamaCppDecoder, LlamaCppVerifier


class LlamaCppBackend:
    """Trees verify on every llama.cpp model with a KV cache (recurrent models draft nothing); once the engine
    batches, rows share each call on streams of their own, as single paths padded to the widest row."""

    name = "llama.cpp"

    def __init__(self, model: LlamaCppModel, config: LookaheadConfig) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_positions: int | None = min(model.trained_context, model.cells)
        self.eos_ids = model.vocabulary.end_ids
        self.draft_mode: DraftMode = "off" if model.recurrent else "tree"
        if model.recurrent:
            warnings.warn(
                f"{model.name}: drafting is off, a recurrent model's state cannot be shared by draft branches; "
                "decoding is plain",
                stacklevel=3,
            )
        if not model.exact and self.draft_mode != "off":
            warnings.warn(
                "this llama-cpp-python build uses llamafile's matrix kernels, whose multi-token passes round "
                "differently from the one-token step: lookahead may differ from plain decoding at near-ties. "
                "For exact verification build it with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF (see README)",
                stacklevel=3,
            )
        self.max_draft = config.decoding_length
        if model.inexact_types and self.draft_mode != "off":
            self._bound_drafts(model, config.decoding_length + 1)
        self.verifier = LlamaCppVerifier(model, self.max_draft, self.draft_mode == "tree", following=config.recycled)

    def _bound_drafts(self, model: LlamaCppModel, wanted: int) -> None:
        """Drafts as single paths no wider than the widest pass found exact on this model (none if no pass is)."""
        widest = widest_exact_pass(model, min(wanted, PROBE_WIDEST))
        types = ", ".join(model.inexact_types)
        if widest < 2:
            self.draft_mode = "off"
            warnings.warn(
                f"{model.name}: llama.cpp's kernels for {types} weights round every pass of several tokens "
                "differently from the one-token step: drafting is off, decoding is plain (see README)",
                stacklevel=4,
            )
            return
        self.draft_mode = "chain"  # a chain leaves no accepted branch to lay again in the next call
        self.max_draft = widest - 1
        measured = f"rounds a pass of more than {widest} tokens differently" if widest < PROBE_WIDEST else (
            f"was measured exact only up to {widest} tokens a pass")  # fmt: skip
        warnings.warn(
            f"{model.name}: llama.cpp's kernels for {types} weights: this file {measured} from the one-token step, so "
            f"a request's drafts here are single paths of at most {widest - 1} tokens: exact, with less speedup than "
            "on F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weights (rows batched together share wider passes; "
            "see README)",
            stacklevel=4,
        )

    def enable_batching(self, max_batch: int) -> bool:
        """Batches run on a context with a KV stream per row (LlamaCppModel.streamed), for every row count the cost
        model measures up to `max_batch`: in the one unified cache every token of a batched call would attend over
        every row's cells. There drafts are single paths and a call's rows are padded to the widest, so a request may
        hold a stream's cells less the widest pass; and requests alone on this engine draft single paths too."""
        if self.model.recurrent:
            return True
        rows = max(max_batch, *measured_rows(max_batch))
        if not (self.verifier.model.streams and self.verifier.model.sequences >= rows):
            self.verifier.use_streams(lambda: self.model.streamed(rows))
        if self.draft_mode == "tree":
            self.draft_mode = "chain"
        self.max_positions = min(self.model.trained_context, self.verifier.model.cells - self.max_draft - 1)
        return False

    def meter(self, batched: bool = False) -> LlamaCppMeter:
        return LlamaCppMeter(self.verifier.model if batched else self.model)


PROBE_CONTEXT = 40
"""Cached tokens before the passes `widest_exact_pass` compares."""
PROBE_WIDEST = 16
"""The widest pass the probe tries (a width past it is not claimed exact)."""


_widest: weakref.WeakKeyDictionary[LlamaCppModel, dict[int, int]] = weakref.WeakKeyDictionary()
"""`widest_exact_pass` of each model, by the widest asked: measured once, whatever engines share the model."""


def widest_exact_pass(model: LlamaCppModel, widest: int) -> int:
    """The most tokens (up to `widest`) a pass may carry with every token getting the logits of its one-token step,
    bit for bit, on this model's kernels: found by reading `widest` tokens after PROBE_CONTEXT cached ones in passes
    of 2, 3, ... tokens against one-token steps (1: no wider pass is exact, or the context has no room to tell).
    Every pass counts, not only the first: on one CPU a K-quant file's first pass kept the step's bits at widths
    whose later passes did not (benchmarks/NOTES.md)."""
    widest = min(widest, model.cells - PROBE_CONTEXT)
    if widest < 2:
        return 1
    known = _widest.setdefault(model, {})
    if widest not in known:
        known[widest] = _measure_widest(model, widest)
    return known[widest]


def _measure_widest(model: LlamaCppModel, widest: int) -> int:
    decoder = LlamaCppDecoder(model)
    tokens = [(100 + 7 * i) % model.vocab_size for i in range(PROBE_CONTEXT + widest)]
    with model.lock:
        sequence = model.take_sequence()
        try:
            decoder([Entry(token, i, (sequence,), False) for i, token in enumerate(tokens[:PROBE_CONTEXT])])
            steps = np.stack([decoder([Entry(tokens[i], i, (sequence,), True)])[0].copy()
                              for i in range(PROBE_CONTEXT, PROBE_CONTEXT + widest)])  # fmt: skip
            for width in range(2, widest + 1):  # every token read in passes of `width`, as a run of chains would be
                model.remove_cells(sequence, PROBE_CONTEXT)
                for start in range(PROBE_CONTEXT, PROBE_CONTEXT + widest, width):
                    end = min(start + width, PROBE_CONTEXT + widest)
                    block = [Entry(tokens[i], i, (sequence,), True) for i in range(start, end)]
                    if not np.array_equal(decoder(block), steps[start - PROBE_CONTEXT : end - PROBE_CONTEXT]):
                        return width - 1
            return widest
        finally:
            model.give_back(sequence)


class LlamaCppMeter:
    """Passes of `rows` sequences of `width` tokens each in one `llama_decode`, as a step of that many rows."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        stat = model.path.stat()
        kernels = "exact" if model.exact else "llamafile"  # another build, other kernels, other costs
        self.key = f"llama.cpp|{model.path}|{stat.st_size}|{stat.st_mtime_ns}|threads={model.threads}|{kernels}"
        self.batch_key = "|streams" if model.streams else ""  # rows in streams of their own: other batched costs
        self.max_positions = min(model.trained_context, model.cells)

    @contextlib.contextmanager
    def passes(self, rows: int, context: int) -> Iterator[Callable[[int], None]]:
        model = self.model
        decoder = LlamaCppDecoder(model)
        prefix = [(100 + 7 * i) % model.vocab_size for i in range(context)]
        with model.lock:
            sequences: list[int] = []
            try:
                sequences += [model.take_sequence() for _ in range(rows)]
                entries = [Entry(token, i, (s,), False) for s in sequences for i, token in enumerate(prefix)]
                for start in range(0, len(entries), BATCH_TOKENS):
                    decoder(entries[start : start + BATCH_TOKENS])

                def run(width: int) -> None:
                    block = [Entry(prefix[i], context + i, (s,), True) for s in sequences for i in range(width)]
                    decoder(block).argmax(-1)  # as a step: every row's choices
                    for sequence in sequences:
                        model.remove_cells(sequence, context)

                yield run
            finally:
                for sequence in sequences:
                    model.give_back(sequence)
