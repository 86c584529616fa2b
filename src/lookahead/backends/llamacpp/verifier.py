"""Verification on llama.cpp: every row's draft tree in one `llama_decode`, a sequence id per leaf.

llama.cpp lets a query attend to the KV cells of its first sequence id at positions up to its
own. So each running generation owns a base sequence (its context); for a step, each leaf of
its tree borrows a sequence id, the base's cells are shared with every leaf (`seq_cp` on a
unified cache copies no data), the root carries the base and every leaf, and each draft node
carries the leaves below it: a node sees exactly its context and its ancestors, the tree mask.
After the walk, the accepted path's cells are added to the base sequence and every leaf
sequence is dropped, so between steps a generation's base holds its tokens but the last (the
next root) and those `pending`, and no leaf holds anything.

Exactness: llama.cpp's attention sums over KV cells in cell order, so a token's logits depend
on where its context's cells lie, not only on what they hold. A call's tokens take consecutive
cells in call order; the tree goes depth first, likeliest child first, so an accepted path
along first children lies exactly where plain decoding would have put it. Tokens accepted on
another branch are not kept where they were computed: they are laid again, in place, at the
front of the generation's next call (`pending`). With llama.cpp built without llamafile's
matrix kernels (whose multi-token sums round differently), a row's outputs then equal plain
decoding's bit for bit.

Rows joined to this verifier share each call; a generation's sequence is taken at `join` and
released at `leave`. Sequence ids are few (llama.cpp allows 256): with `rows` rows joined, a
row's tree may have at most (256 - rows) // rows leaves (`max_leaves`).

On a context with a KV stream per sequence (`use_streams`, for batches) a token belongs to one
sequence only, so drafts are single paths written straight into the row's own sequence, and
the cells past the accepted ones are dropped after the walk. llama.cpp puts a call in one pass
only if its rows are consecutive sequence ids with equally many tokens: the rows hold ids 0, 1,
... (a row that leaves is replaced by the last, its stream copied cell for cell), and every
row, and every id between them that has no row in the call, is padded to the widest row's
tokens with cells dropped after the pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...decoding.generation import Generation
from ...decoding.sampling import likeliest
from ...decoding.step import Verdict
from ...decoding.verify import accept, node_choice
from ...drafting.tree import DraftTree
from .model import BATCH_TOKENS, LlamaCppModel


class Entry(NamedTuple):
    """One token of a decode call."""

    token: int
    position: int
    sequences: Sequence[int]
    logits: bool


class KVCacheFull(RuntimeError):
    """llama.cpp found no room in its KV cache for a call."""


class LlamaCppDecoder:
    """`llama_decode` over lists of entries, on one model's context; the logits of the entries that ask for them."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.lib = model.lib
        self._batch = self.lib.llama_batch_init(BATCH_TOKENS, 0, model.sequences)
        self._vocab = model.vocab_size

    def __del__(self) -> None:
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self.lib.llama_batch_free(batch)

    def __call__(self, entries: Sequence[Entry]) -> np.ndarray:
        """Logits (one row per entry asking for them, in order) of one call; valid until the next call."""
        if len(entries) > BATCH_TOKENS:
            raise ValueError(f"a decode call takes at most {BATCH_TOKENS} tokens, got {len(entries)}")
        batch, lib = self._batch, self.lib
        outputs = 0
        for i, (token, position, sequences, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = len(sequences)
            ids = batch.seq_id[i]
            for j, sequence in enumerate(sequences):
                ids[j] = sequence
            batch.logits[i] = logits
            outputs += logits
        batch.n_tokens = len(entries)
        status = lib.llama_decode(self.model.ctx, batch)
        if status == 1:
            raise KVCacheFull(
                f"llama.cpp's KV cache ({self.model.cells} cells) is full: load the model with a larger context"
            )
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        if not outputs:
            return np.zeros((0, self._vocab), dtype=np.float32)
        return np.ctypeslib.as_array(lib.llama_get_logits(self.model.ctx), shape=(outputs, self._vocab))


def _tree_layout(tree: DraftTree) -> tuple[list[int], list[int], list[list[int]]]:
    """The block indices in the order a call carries them, the leaves, and per block index the leaves below it.

    The order is depth first, earlier (likelier) children first, so the likeliest path takes
    consecutive KV cells right after the context, as plain decoding would place its tokens:
    llama.cpp's attention sums over cells in cell order, so a path accepted there keeps the
    exact layout (and rounding) of plain decoding.
    """
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for index, parent in enumerate(tree.parents, start=1):
        children[parent].append(index)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    leaves = [index for index in order if index and not children[index]]
    below: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for number, leaf in enumerate(leaves):
        node = leaf
        while True:
            below[node].append(number)
            if node == 0:
                break
            node = tree.parents[node - 1]
    return order, leaves, below


class LlamaCppVerifier:
    """Prefill and verification of generations on one llama.cpp context."""

    batched = True

    def __init__(self, model: LlamaCppModel, max_draft: int, branching: bool = True, following: int = 0) -> None:
        self.model = model
        self.decoder = LlamaCppDecoder(model)
        self.max_draft = max_draft
        self.branching = branching
        self.following = following
        """Likeliest next tokens a verdict gives per verified position (the root and each node) for a drafting
        generation (Verdict.following); 0: none."""
        self._sequence: dict[Generation, int] = {}
        """Each joined generation's base sequence id (taken from the model, which every engine on it shares)."""
        self._pending: dict[Generation, int] = {}
        """Each generation's last accepted tokens whose cells were not where plain decoding puts them (a branch
        other than the first was accepted): left out of its sequence and laid again at the front of its next call."""

    # ---- rows --------------------------------------------------------------------------------

    def join(self, generation: Generation) -> None:
        if generation in self._sequence:
            raise ValueError("this generation has already joined")
        with self.model.lock:
            self._sequence[generation] = self.model.take_sequence(row=True)

    def leave(self, generation: Generation) -> None:
        """The generation's sequence is kept by the model for its prefix (see LlamaCppModel.keep_prefix); on streams
        it is freed, and the row of the highest id moves into it."""
        pending = self._pending.pop(generation, 0)
        sequence = self._sequence.pop(generation, None)
        if sequence is not None and self.model.streams:
            with self.model.lock:
                self._close_gap(sequence)
        elif sequence is not None:
            with self.model.lock:
                cached = self.model.last_position(sequence) + 1
                self.model.keep_prefix(sequence, generation.tokens[: min(cached, len(generation.tokens) - 1 - pending)])

    def use_streams(self, make: Callable[[], LlamaCppModel]) -> None:
        """Verify from now on on the context `make` returns, one with a stream per sequence (LlamaCppModel.streamed);
        RuntimeError while rows run on this one."""
        if self._sequence:
            raise RuntimeError(
                f"a larger batch cannot start while {len(self._sequence)} rows run on this engine's llama.cpp context "
                f"(of {self.model.sequences} sequences): start the larger batch first"
            )
        self.model = make()
        self.decoder = LlamaCppDecoder(self.model)

    def _close_gap(self, sequence: int) -> None:
        """Free a leaving row's stream; the row of the highest id, if above it, moves in (its stream copied)."""
        model = self.model
        last = max(self._sequence, key=self._sequence.__getitem__, default=None)
        if last is None or self._sequence[last] < sequence:
            model.give_back(sequence, row=True)
            return
        highest = self._sequence[last]
        model.copy_cells(highest, sequence)  # the whole stream, over the leaving row's cells
        self._sequence[last] = sequence
        model.give_back(highest, row=True)

    def max_leaves(self, generation: Generation) -> int:
        """The model's sequence ids shared out among the running rows (each keeps one for itself)."""
        if not self.branching or self.model.streams:
            return 1
        rows = max(self.model.rows, 1)
        return max(1, min(self.max_draft, (self.model.sequences - rows) // rows))

    def pending(self, generation: Generation) -> int:
        """The generation's accepted tokens not yet in its sequence (laid again at its next call)."""
        return self._pending.get(generation, 0)

    def sequence(self, generation: Generation) -> int:
        """The generation's base sequence id (KeyError if it has not joined)."""
        return self._sequence[generation]

    # ---- the model's work ------------------------------------------------------------------------

    def prefill(self, generations: Sequence[Generation], counts: Sequence[int]) -> list[int | None]:
        """Every row's next prompt tokens in as few calls as fit; each completed prompt's first token."""
        entries: list[Entry] = []
        finishing: list[Generation] = []
        ordered = list(zip(generations, counts, strict=True))
        if self.model.streams:  # by sequence id: llama.cpp puts consecutive streams in one pass
            ordered.sort(key=lambda row: self._sequence[row[0]])
        for generation, count in ordered:
            if not generation.prefilled:
                with self.model.lock:
                    generation.prefilled = self.model.reuse_prefix(generation.prompt, self._sequence[generation])
            read, prompt = generation.prefilled, generation.prompt
            end = min(read + count, len(prompt))
            sequence = self._sequence[generation]
            for position in range(read, end):
                last = position == len(prompt) - 1
                entries.append(Entry(prompt[position], position, (sequence,), last))
                if last:
                    finishing.append(generation)
            generation.prefilled = end
        clock = time.perf_counter()
        rows: list[np.ndarray] = []
        with self.model.lock:
            for start in range(0, len(entries), BATCH_TOKENS):
                logits = self.decoder(entries[start : start + BATCH_TOKENS])
                rows.extend(np.array(logits[i : i + 1]) for i in range(len(logits)))  # the next call overwrites them
        firsts = {
            generation: node_choice(generation, row, generation.prompt)(0, [])
            for generation, row in zip(finishing, rows, strict=True)
        }
        spent = (time.perf_counter() - clock) / max(len(generations), 1)
        for generation in generations:
            generation.stats.prefill_s += spent
        return [firsts.get(generation) for generation in generations]

    def verify(self, generations: Sequence[Generation], trees: Sequence[DraftTree]) -> tuple[list[Verdict], float]:
        decoder, model = self.decoder, self.model
        streams = model.streams
        entries: list[Entry] = []
        plans: list[tuple[int, DraftTree, int, list[int], list[int], list[int]]] = []
        gaps: list[tuple[int, int]] = []
        """Sequences padded in a call that are not its rows: (id, the first position padded)."""
        rows = range(len(generations))
        if streams:  # consecutive ids, equally many tokens each
            rows = sorted(rows, key=lambda row: self._sequence[generations[row]])
            width = max(len(tree) + 1 + self._pending.get(generations[row], 0) for row, tree in enumerate(trees))
        with model.lock:
            previous = None
            for row in rows:
                generation, tree = generations[row], trees[row]
                base = self._sequence[generation]
                past = len(generation.tokens) - 1
                pending = self._pending.get(generation, 0)
                if model.last_position(base) != past - 1 - pending:
                    raise RuntimeError("a generation's llama.cpp sequence does not match its tokens")
                if streams:
                    for gap in range(base if previous is None else previous + 1, base):
                        start = model.last_position(gap) + 1
                        gaps.append((gap, start))
                        entries.extend(Entry(0, start + i, (gap,), False) for i in range(width))
                    previous = base
                order, leaves, below = _tree_layout(tree)
                borrowed = [] if streams else [model.take_sequence() for _ in leaves]
                for leaf in borrowed:
                    model.copy_cells(base, leaf)
                for position in range(past - pending, past):  # accepted last step, but not in place: laid again
                    entries.append(Entry(generation.tokens[position], position, (base, *borrowed), False))
                depths = [0, *tree.depths]
                tokens = [generation.tokens[-1], *tree.tokens]
                plans.append((row, tree, base, leaves, borrowed, [len(entries) + i for i in np.argsort(order)]))
                for index in order:
                    sequences = [base, *borrowed] if not index or streams else [borrowed[n] for n in below[index]]
                    entries.append(Entry(tokens[index], past + depths[index], sequences, True))
                if streams:  # cells dropped after the walk, with the nodes turned down
                    padding = width - len(tree) - 1 - pending
                    entries.extend(Entry(tokens[0], past + 1 + len(tree) + i, (base,), False) for i in range(padding))
            tick = time.perf_counter()
            try:
                logits = decoder(entries)
            except Exception:
                for *_, borrowed, _ in plans:
                    self._release(borrowed)
                raise
            finally:
                for gap, start in gaps:
                    model.remove_cells(gap, start)
            tock = time.perf_counter()
            verdicts: dict[int, Verdict] = {}
            outputs = np.cumsum([entry.logits for entry in entries]) - 1  # an entry's row among the logits
            drafting = self.following > 0 and any(generation.drafter is not None for generation in generations)
            top = likeliest(logits, self.following) if drafting else None  # every output's, in one call, no copy
            for row, tree, base, leaves, borrowed, places in plans:
                generation = generations[row]
                block = [logits[outputs[place]] for place in places]  # by block index
                accepted, emitted = accept(tree, node_choice(generation, block, generation.tokens))
                following = top[outputs[places]] if top is not None and generation.drafter is not None else None
                verdicts[row] = Verdict(accepted, emitted, following)
                past = len(generation.tokens) - 1
                if streams:  # a path laid in place: keep its cells, drop those of the nodes turned down and pads
                    model.remove_cells(base, past + 1 + len(accepted))
                    continue
                in_place = next((i for i, n in enumerate(accepted) if places[n] != places[0] + 1 + i), len(accepted))
                if in_place:
                    leaf = borrowed[leaves.index(_leaf_under(tree, accepted[in_place - 1]))]
                    model.copy_cells(leaf, base, past + 1, past + 1 + in_place)
                self._pending[generation] = len(accepted) - in_place
                self._release(borrowed)
            done = time.perf_counter()
        for generation in generations:
            stats = generation.stats
            stats.forward_s += tock - tick
            stats.verify_s += done - tock
        return [verdicts[row] for row in range(len(generations))], (tock - tick) * 1000

    def _release(self, borrowed: list[int]) -> None:
        for leaf in reversed(borrowed):
            self.model.give_back(leaf)


def _leaf_under(tree: DraftTree, node: int) -> int:
    """A leaf (block index) at or below block index `node`."""
    children: dict[int, int] = {}
    for index, parent in enumerate(tree.parents, start=1):
        children.setdefault(parent, index)
    while node in children:
        node = children[node]
    return node
