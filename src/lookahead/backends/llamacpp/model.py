"""A GGUF model loaded by llama.cpp, as it is (quantized types included), with one context all requests share.

The context's KV cache is unified (every sequence's cells in one buffer), which is what lets a
draft tree go into one `llama_decode` with a sequence id per leaf (verifier.py), and lets
requests share a call. Flash attention is off, as in llama-cpp-python's own `Llama` by
default, so plain decoding here runs the same kernels as that reference. (Its CPU kernel would
skip other rows' cells, but sums a one-token step over a long context in per-thread chunks and
a pass of several tokens in one run, so the two would round differently.)

In a unified cache every token of a batched call attends over every row's cells (masked), so a
batch's step grows with the sum of its rows' contexts. `streamed(rows)` gives batches a sibling
context on the same weights with a KV stream per sequence: each row reads only its own cells, at
the price of no token in two sequences (drafts are single paths) and rows of equal widths.

The tokenizer stays the transformers one (chat templates, incremental detokenization): at
load its vocabulary must match the GGUF's id for id, or the model is refused.
"""

from __future__ import annotations

import copy
import ctypes
import heapq
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

SUPPORTED = ((0, 3, 36), (0, 3, 37))
"""llama-cpp-python versions [low, high) whose C API this module was written against (llama.cpp renames often)."""
INSTALL = "pip install 'lookahead[llama]'"
BATCH_TOKENS = 1024
"""Most tokens one `llama_decode` call takes (a prompt is read in calls of at most this many)."""
STREAM_CELLS = 2048
"""Fewest KV cells a row's stream gets in a streamed context (`LlamaCppModel.streamed`), which bounds a batched
request's tokens unless the model's `context` gives each stream more."""
EXACT_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})
"""Weight types whose passes of 2-16 tokens give each token the one-token step's logits, bit for bit, on a build
without llamafile's kernels (measured on all of them; the tests hold Q8_0, Q4_0 and the bundled Q4_1 and F32 files).
The K-quants' do not: on Q4_K and Q6_K weights a pass of 8 tokens or more rounds otherwise (and Q4_K weights that
llama.cpp repacks for the CPU, of 4 or more), so the backend measures how wide a pass may be on such a file."""


def binding() -> Any:
    """The `llama_cpp` module, checked against the supported versions; ValueError (one line) if absent or other."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        raise ValueError(f"the llama.cpp backend needs llama-cpp-python, which is not installed: {INSTALL}") from None
    parts = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    low, high = SUPPORTED
    if not low <= parts < high:
        supported = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise ValueError(f"llama-cpp-python {version} is not supported (this lookahead needs {supported}): {INSTALL}")
    logger = logging.getLogger("llama-cpp-python")  # llama.cpp logs every load to stderr unless told not to
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)
    import llama_cpp

    return llama_cpp


@dataclass(frozen=True)
class Vocabulary:
    """What the engine needs of the GGUF's vocabulary."""

    size: int
    end_ids: frozenset[int]
    """Tokens llama.cpp ends a generation at (its end-of-generation set)."""


class LlamaCppModel:
    """A GGUF file on llama.cpp with one context: the weights, a unified KV cache, `threads` CPU threads (and, made
    by `streamed`, contexts on the same weights with a stream per sequence, one per batching engine).

    The context's sequence ids are handed out here, so every engine on this model shares them
    without overlap.

    `context`: KV cells shared by all requests at once (default: the model's trained context, at
    most 32,768); `sequences`: llama.cpp sequence ids (each running request takes one, and each
    leaf of its draft tree one more while it is verified).
    """

    runtime = "llama.cpp"
    """Which backend the engine runs this model on (lookahead/engine.py: backend_for)."""

    def __init__(
        self,
        path: str | os.PathLike,
        tokenizer: Any,
        threads: int | None = None,
        context: int | None = None,
        sequences: int | None = None,
    ) -> None:
        lib = self.lib = binding()
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.threads = threads or os.cpu_count() or 1
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not model:
            raise ValueError(f"{self.path}: llama.cpp cannot load this GGUF file")
        self._model = model
        self._finalizer = weakref.finalize(self, _free, lib, model, [])
        self.recurrent = bool(lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model))
        """Recurrent state is not cells that sequence ids can share: such a model verifies no drafts."""
        self.vocab = lib.llama_model_get_vocab(model)
        self.vocabulary = self._read_vocabulary()
        if tokenizer is not None:
            check_vocabulary(self._token_texts(), tokenizer, self.path.name)
        self.trained_context = int(lib.llama_model_n_ctx_train(model))
        self.name = self.path.name
        self.file_type = _file_type(lib, model)
        self.exact = b"LLAMAFILE = 1" not in lib.llama_print_system_info()
        """True if multi-token passes sum as the one-token step does (a build without llamafile's kernels)."""
        self.inexact_types = tuple(sorted(weight_types(lib, self.path) - EXACT_TYPES))
        """The file's weight types not known to round a multi-token pass as the one-token step (none: all are)."""
        self.streams = False
        """True if each sequence has a KV stream of its own (see `streamed`)."""
        sequences = min(sequences or lib.llama_max_parallel_sequences(), lib.llama_max_parallel_sequences())
        self._contexts: list[Any] = []
        """Every context made on these weights (this one's and its streamed siblings'), freed with them."""
        self._open(context or min(self.trained_context, 32768), sequences)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _free, lib, model, self._contexts)

    def _open(self, cells: int, sequences: int) -> None:
        """Make this object's context: `cells` KV cells in all, for `sequences` sequence ids."""
        lib = self.lib
        self.sequences = sequences
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = cells
        cparams.n_batch = cparams.n_ubatch = BATCH_TOKENS
        cparams.n_seq_max = sequences
        cparams.kv_unified = not self.streams
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        ctx = lib.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise ValueError(f"{self.path}: llama.cpp cannot make a context of {cells} cells for this model")
        self.ctx = ctx
        self._contexts.append(ctx)
        self.cells = int(lib.llama_n_ctx_seq(ctx))
        """KV cells one sequence may hold (all of them in a unified cache)."""
        self.memory = lib.llama_get_memory(ctx)
        self.lock = threading.Lock()
        """Held by whoever is using the context (one decode at a time)."""
        self._free = list(range(sequences))
        """Sequence ids no one holds, a heap: the lowest is handed out first (rows on streams stay consecutive)."""
        self.rows = 0
        """Sequence ids held between steps: running generations' and the kept prefix's, not a step's leaves."""
        self._kept: tuple[int, list[int]] | None = None
        """The sequence and tokens of the last generation to end, kept for the next prompt's common prefix."""

    def streamed(self, rows: int) -> LlamaCppModel:
        """A new context on these weights for batches of up to `rows` rows, each sequence with a KV stream of its
        own (an engine's batches run on one of their own). Its cells, as many as this context's but at least
        STREAM_CELLS a stream, are split evenly among the streams, as llama.cpp's server splits its context among
        its slots. Freed when collected, or with these weights."""
        if self.streams:
            raise ValueError("this context already has a stream per sequence")
        if rows > (most := self.lib.llama_max_parallel_sequences()):
            raise ValueError(f"llama.cpp allows at most {most} sequences, so batches of at most {most} rows")
        sibling = copy.copy(self)
        sibling.streams = True
        sibling._weights = self  # the weights stay loaded while a context on them lives
        sibling._open(max(self.cells, rows * STREAM_CELLS), rows)
        sibling._finalizer = weakref.finalize(sibling, _free_context, self.lib, sibling.ctx, self._contexts)
        return sibling

    def take_sequence(self, row: bool = False) -> int:
        """A sequence id no one holds, with no cells (the lowest free); `row`: for a generation, not a leaf."""
        if not self._free:
            raise RuntimeError(f"llama.cpp allows {self.sequences} sequences: all are in use")
        self.rows += row
        return heapq.heappop(self._free)

    def give_back(self, sequence: int, row: bool = False) -> None:
        """Drop `sequence`'s cells and make it free again."""
        self.remove_cells(sequence)
        self.rows -= row
        heapq.heappush(self._free, sequence)

    # ---- the memory: sequences of cells (call with the lock held) --------------------------------

    def copy_cells(self, source: int, target: int, start: int = -1, end: int = -1) -> None:
        """Add `target` to the cells of `source` at positions [start, end) (-1: open); no data moves. With a stream
        per sequence only whole sequences are copied: `target`'s stream becomes a copy of `source`'s (cell for cell,
        at the next decode)."""
        self.lib.llama_memory_seq_cp(self.memory, source, target, start, end)

    def remove_cells(self, sequence: int, start: int = -1, end: int = -1) -> None:
        """Take `sequence` off its cells at positions [start, end) (-1: open); a cell of no sequence is freed."""
        self.lib.llama_memory_seq_rm(self.memory, sequence, start, end)

    def last_position(self, sequence: int) -> int:
        """The highest position `sequence` holds a cell at; -1 if none."""
        return int(self.lib.llama_memory_seq_pos_max(self.memory, sequence))

    @property
    def kept(self) -> int | None:
        """The sequence kept for its prefix, if any."""
        return None if self._kept is None else self._kept[0]

    def keep_prefix(self, sequence: int, tokens: list[int]) -> None:
        """Keep a finished generation's sequence (a row's id, held) and its `tokens` for the next prompt's prefix,
        as llama.cpp's own loop keeps its last prompt; the one kept before is freed."""
        if self._kept is not None:
            self.give_back(self._kept[0], row=True)
        self._kept = (sequence, tokens)

    def reuse_prefix(self, prompt: list[int], sequence: int) -> int:
        """Give the empty `sequence` the cells of the kept tokens it shares a prefix with (all but the prompt's last
        token, which must be read for its logits); how many. The kept sequence is cut there, so the rest of the
        prompt takes the next cells, where reading the whole prompt would have put it."""
        if self._kept is None:
            return 0
        kept, tokens = self._kept
        common = 0
        for a, b in zip(tokens, prompt[:-1], strict=False):
            if a != b:
                break
            common += 1
        if common:
            self.remove_cells(kept, common)
            self.copy_cells(kept, sequence, 0, common)
            self._kept = (kept, tokens[:common])
        return common

    @property
    def vocab_size(self) -> int:
        return self.vocabulary.size

    def _read_vocabulary(self) -> Vocabulary:
        lib, vocab = self.lib, self.vocab
        size = int(lib.llama_vocab_n_tokens(vocab))
        ends = frozenset(token for token in range(size) if lib.llama_vocab_is_eog(vocab, token))
        return Vocabulary(size, ends)

    def _token_texts(self) -> list[str]:
        lib, vocab = self.lib, self.vocab
        return [lib.llama_vocab_get_text(vocab, token).decode("utf-8", "replace") for token in range(self.vocab_size)]

    def close(self) -> None:
        """Free the weights and every context on them now (else when the model is collected); on a streamed
        context, that context only."""
        self._finalizer()


FILE_TYPES = {"float32": "ALL_F32", "float16": "MOSTLY_F16", "bfloat16": "MOSTLY_BF16"}
"""A dtype's llama.cpp file type (LLAMA_FTYPE_...)."""


def convert(source: Path, target: Path, dtype: str) -> None:
    """Write `source`'s weights as `dtype` to `target`, with llama.cpp's own quantizer (dequantizing as it goes)."""
    lib = binding()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_{FILE_TYPES[dtype]}")
    params.allow_requantize = True  # a quantized source is dequantized to float first
    params.nthread = os.cpu_count() or 1
    if lib.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"{source}: llama.cpp could not convert this GGUF file to {dtype}")


class _GgufParams(ctypes.Structure):
    """ggml's `gguf_init_params`: read the header only (no tensor data), into no ggml context."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def weight_types(lib: Any, path: Path) -> set[str]:
    """The GGML types of a GGUF file's tensors (e.g. 'Q4_K', 'F32'), read from its header by ggml's own GGUF reader
    (the `gguf` package's reader parses the whole vocabulary in Python first: seconds a load); {'unknown'} if it
    cannot read them, so that the backend measures the file's passes instead of trusting them."""
    ggml = lib.llama_cpp._lib  # the gguf_* functions llama.cpp loads files with; llama-cpp-python binds none of them
    ggml.gguf_init_from_file.argtypes, ggml.gguf_init_from_file.restype = (
        [ctypes.c_char_p, _GgufParams],
        ctypes.c_void_p,
    )
    ggml.gguf_get_n_tensors.argtypes, ggml.gguf_get_n_tensors.restype = [ctypes.c_void_p], ctypes.c_int64
    ggml.gguf_get_tensor_type.argtypes, ggml.gguf_get_tensor_type.restype = (
        [ctypes.c_void_p, ctypes.c_int64],
        ctypes.c_int,
    )
    ggml.ggml_type_name.argtypes, ggml.ggml_type_name.restype = [ctypes.c_int], ctypes.c_char_p
    ggml.gguf_free.argtypes, ggml.gguf_free.restype = [ctypes.c_void_p], None
    header = ggml.gguf_init_from_file(str(path).encode(), _GgufParams(True, None))
    if not header:
        return {"unknown"}
    try:
        tensors = range(ggml.gguf_get_n_tensors(header))
        names = [ggml.ggml_type_name(ggml.gguf_get_tensor_type(header, tensor)) for tensor in tensors]
    finally:
        ggml.gguf_free(header)
    return {name.decode().upper() if name else "unknown" for name in names}


def check_vocabulary(texts: list[str], tokenizer: Any, name: str) -> None:
    """ValueError, in one line, unless the tokenizer's tokens are the GGUF's `texts` id for id."""
    known = len(tokenizer)
    if known > len(texts):
        raise ValueError(f"{name}: the tokenizer has {known} tokens, the GGUF vocabulary {len(texts)}: another model's")
    mine = tokenizer.convert_ids_to_tokens(list(range(known)))
    for token, (theirs, ours) in enumerate(zip(texts, mine, strict=False)):
        if theirs != ours:
            raise ValueError(
                f"{name}: token {token} is {theirs!r} in the GGUF vocabulary but {ours!r} in the tokenizer: "
                "the tokenizer is not this model's"
            )


def _file_type(lib: Any, model: Any) -> str:
    """The GGUF's own description of its weights' type (e.g. 'Q4_1', 'F32', 'Q4_K - Medium'): what llama.cpp's
    description says after the architecture and size."""
    text = ctypes.create_string_buffer(256)
    lib.llama_model_desc(model, text, len(text))
    *_, kind = text.value.decode("utf-8", "replace").split(" ", 2)
    return kind.removeprefix("all ")


def _free(lib: Any, model: Any, contexts: list[Any]) -> None:
    while contexts:
        lib.llama_free(contexts.pop())
    lib.llama_model_free(model)


def _free_context(lib: Any, ctx: Any, contexts: list[Any]) -> None:
    """Free a streamed context unless its weights went first (and freed it with them)."""
    if any(ctx is other for other in contexts):
        contexts[:] = [other for other in contexts if other is not ctx]
        lib.llama_free(ctx)
