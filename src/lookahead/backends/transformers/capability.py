"""Does this model honour a custom tree mask? Checked once, by comparison with sequential decoding.

Some architectures derive positions or biases from a 2-D padding mask (OPT, ALiBi models)
and silently misread a 4-D one. Rather than keep a list of names, we run a tiny tree through
the model and compare every node's logits with plain decoding of its path: the prefix read in
one pass, then a token a step (in bfloat16 a single fresh pass over the whole path rounds
otherwise than those steps, on a CPU without bfloat16 instructions by several logits).
A model that fails gets single-path drafts (or none), with a warning that says why.

Within float tolerance is not enough in bfloat16 or float16: a wider pass rounds otherwise than
a one-token step, and where the top two logits tie, a draft can flip a token. There the engine
verifies chains node by node (attention.py: NODEWISE_SDPA) if that gives every node the bits of
its one-token step, checked the same way, bit for bit, at every width it may send; the products
of a batch's wider passes are made in pieces no wider than that (linears.packed_as), and prompts
are read in the same passes alone or in a batch (verifier.PROMPT_PIECE). Else it keeps its
drafts and warns.
Each probe runs once per model (and dtype, device, attention implementation): every later
engine on the same model reuses the answer, and repeats the warning.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Literal, TypeVar

import torch
from transformers import Cache

from ...decoding.backend import DraftMode
from ...drafting.tree import DraftTree
from .decoder import DirectDecoder
from .forward import ModelForward
from .kvcache import BatchCache, has_sliding_layers
from .slab import SlabCache

Layout = Literal["packed", "padded"]
"""How the rows of a batch share a forward pass: packed (decoding/slab.py) or padded to the widest (kvcache.py)."""

# root r; nodes a, b under r; c under a; d under c: paths r-a-c-d and r-b.
_TREE = DraftTree(tokens=[11, 12, 13, 14], parents=[0, 0, 1, 3])
_CHAIN = DraftTree(tokens=[11, 13, 14], parents=[0, 1, 2])
_PREFIX = [5, 6, 7, 8, 9, 10]
_ROOT = 4
_NEXT = 15
_BITS_PREFIX = 24

T = TypeVar("T")
_ANSWERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, object]] = weakref.WeakKeyDictionary()


def _once(forward: ModelForward, question: str, probe: Callable[[], T]) -> T:
    """`probe()`'s answer for this model, computed the first time it is asked: the same weights answer the same."""
    model = forward.model
    key = (question, model.dtype, str(forward.device), getattr(model.config, "_attn_implementation", None))
    answers = _ANSWERS.setdefault(model, {})
    if key not in answers:
        answers[key] = probe()
    return answers[key]  # type: ignore[return-value]


def _gap(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The largest logit difference if it is beyond float noise for the dtype, else None."""
    tolerance = 1e-3 if got.dtype == torch.float32 else 5e-2
    scale = max(1.0, float(want.abs().max()))
    gap = float((got.float() - want.float()).abs().max())
    return gap if gap > tolerance * scale else None


def _plain_logits(forward: ModelForward, tokens: list[int]) -> torch.Tensor:
    """Logits of a fresh causal forward over `tokens`."""
    return forward(forward.new_cache(), tokens, 0)


def _stepped_logits(forward: ModelForward, prefix: list[int], path: list[int]) -> list[torch.Tensor]:
    """Plain decoding's logits after each token of `path`: `prefix` read in one pass, then a token a step."""
    cache = _prefilled(forward, prefix)
    return [forward(cache, [token], len(prefix) + offset)[-1] for offset, token in enumerate(path)]


def _mismatch(forward: ModelForward, tree: DraftTree) -> str | None:
    """Why the tree's logits (or the compacted cache) differ from plain decoding; None if they do not."""
    vocab = forward.vocab_size
    tokens = [t % vocab for t in tree.tokens]
    tree = DraftTree(tokens, tree.parents)
    prefix = [t % vocab for t in _PREFIX]
    root, nxt = _ROOT % vocab, _NEXT % vocab
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, prefix, 0)
        got = forward(cache, [root, *tokens], len(prefix), tree)
        block_paths: list[list[int]] = [[root]]
        for token, parent in zip(tokens, tree.parents, strict=True):
            block_paths.append([*block_paths[parent], token])
        kept = max(range(len(block_paths)), key=lambda i: len(block_paths[i]))  # the deepest leaf
        want: dict[int, torch.Tensor] = {}
        for leaf in sorted(set(range(len(block_paths))) - set(tree.parents)):  # each path stepped once, to a leaf
            stepped = _stepped_logits(forward, prefix, [*block_paths[leaf], *([nxt] if leaf == kept else [])])
            want.update(zip([0, *_ancestors(tree, leaf)], stepped, strict=False))  # the kept leaf steps once more
            if leaf == kept:
                want_next = stepped[-1]
        for index in range(len(block_paths)):
            if (gap := _gap(got[index], want[index])) is not None:
                return f"logits at draft node {index} differ from sequential decoding by {gap:.3g}"
        accepted = _ancestors(tree, kept)
        BatchCache(cache, [len(prefix)], [None]).keep([[0, *accepted]], len(tokens) + 1)
        got_next = forward(cache, [nxt], len(prefix) + len(accepted) + 1)[-1]
        if (gap := _gap(got_next, want_next)) is not None:
            return f"the step after compacting the cache differs from sequential decoding by {gap:.3g}"
    return None


def _ancestors(tree: DraftTree, index: int) -> list[int]:
    """Block indices from the root's child down to `index`."""
    path = []
    while index:
        path.append(index)
        index = tree.parents[index - 1]
    return path[::-1]


def check_cached_decoding(forward: ModelForward) -> None:
    """Raise if a cached step differs from a fresh forward: plain decoding itself would be wrong.

    This catches a model (or transformers version) that silently ignores the cache it is given.
    """
    if _once(forward, "cached decoding", lambda: _cache_gap(forward)) is not None:
        raise RuntimeError(
            f"{type(forward.model).__name__} does not continue from the cache the engine passes it: "
            "this model or transformers version is not supported"
        )


def _cache_gap(forward: ModelForward) -> float | None:
    vocab = forward.vocab_size
    prefix, root = [t % vocab for t in _PREFIX], _ROOT % vocab
    with torch.inference_mode():
        cache = forward.new_cache()
        forward(cache, prefix, 0)
        got = forward(cache, [root], len(prefix))[-1]
        want = _plain_logits(forward, [*prefix, root])[-1]
    return _gap(got, want)


_MODEL_FAILED = "the model failed"


def check_direct_decoder(forward: ModelForward) -> None:
    """Run the model's layers as one loop (`forward.decoder`, decoder.py) if it is Llama-shaped and the loop gives
    the model's own logits bit for bit: prompts read, one-token steps, a draft tree, a packed batch of two rows and
    a last-only read. Called before the forward is shared: nothing else runs passes through it meanwhile. A model
    the loop is for that fails the check is warned of, with where it differs: its steps run slower, through the
    model's forward."""
    decoder = DirectDecoder.of(forward.model)
    if decoder is None:
        return
    difference = _once(forward, "direct decoder", lambda: _direct_difference(forward, decoder))
    if difference is not None and decoder.loop is not None:  # the compiled loop's calls differ: the Python loop's
        decoder.loop = None
        difference = _once(forward, "direct decoder in Python", lambda: _direct_difference(forward, decoder))
    if difference is None:
        forward.decoder = decoder
    elif not difference.startswith(_MODEL_FAILED):  # a pass the model cannot run: the later probes say why
        warnings.warn(
            f"{type(forward.model).__name__}'s layers run through its own forward, slower: run as one loop they do "
            f"not give its logits bit for bit ({difference})",
            stacklevel=3,
        )


def _direct_difference(forward: ModelForward, decoder: DirectDecoder) -> str | None:
    """Where the direct decoder's logits differ from the model's forward in any bit (or why it could not run); None
    if nowhere."""
    prior = forward.decoder
    try:
        forward.decoder = None
        want = _decoder_passes(forward)
        forward.decoder = decoder
        got = _decoder_passes(forward)
    except Exception as error:  # a pass neither can run (the later probes say why) or only the model's forward can
        return f"{_MODEL_FAILED if forward.decoder is None else 'the direct decoder failed'}: {error}"
    finally:
        forward.decoder = prior
    for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
        if not torch.equal(expected, actual):
            return f"pass {index}: {float((expected.float() - actual.float()).abs().max()):.3g}"
    return None


def _decoder_passes(forward: ModelForward) -> list[torch.Tensor]:
    vocab = forward.vocab_size
    prompts = [[t % vocab for t in _PREFIX * 11], [t % vocab for t in _PREFIX * 4]]
    tree = DraftTree([t % vocab for t in _TREE.tokens], _TREE.parents)
    root, nxt = _ROOT % vocab, _NEXT % vocab
    with torch.inference_mode():
        caches = [forward.new_cache() for _ in prompts]
        out = [forward(cache, prompt, 0) for cache, prompt in zip(caches, prompts, strict=True)]
        out.append(forward(caches[0], [root], len(prompts[0]), DraftTree()))
        out.append(forward(caches[0], [nxt, *tree.tokens], len(prompts[0]) + 1, tree))
        caches[0].crop(-len(tree) - 1)
        parts = [BatchCache(cache, [cache.get_seq_length()], [row]) for row, cache in enumerate(caches)]
        batch = SlabCache.merge(parts)
        out += forward.rows(batch.cache, [[nxt, *tree.tokens], [root]], [tree, DraftTree()], batch.lengths, True)
        out.append(forward(forward.new_cache(), [*prompts[1], root], 0, last_only=True))
    return out


def probe_draft_mode(forward: ModelForward) -> DraftMode:
    """'tree' if branching drafts verify exactly, else 'chain' if single paths do, else 'off'.

    A fallback warns with the reason, so a model that loses tree drafts never does so silently.
    """
    mode, warning = _once(forward, "draft mode", lambda: _draft_mode(forward))
    if warning is not None:
        warnings.warn(warning, stacklevel=3)
    return mode


def low_precision(forward: ModelForward) -> bool:
    """bfloat16 or float16: a pass's width changes its rounding enough to flip near-ties."""
    return forward.model.dtype in (torch.bfloat16, torch.float16)


def settle_rounding(forward: ModelForward, mode: DraftMode, widest: int) -> tuple[DraftMode, int]:
    """What a low-precision model drafts, and the widest block (root and nodes) one pass may verify: chains verified
    node by node ('chain', `forward.nodewise` set) up to the widest block, of at most `widest`, at which every
    node still gets the bits of its one-token step; where no chain does, `mode`, warned that near-ties may break.
    Packed products of verification passes are then made in pieces no wider than what was checked
    (`forward.most_rows`). A float32 model, or one that does not draft, keeps `mode` and `widest`."""
    if mode == "off" or not low_precision(forward):
        return mode, widest
    layers = "packed" if forward.linears is not None else "model's"
    question = f"rounding of chains of {widest}, {layers} layers, {torch.get_num_threads()} threads"
    exact, most_rows, reason = _once(forward, question, lambda: _nodewise_widths(forward, widest))
    name = type(forward.model).__name__
    forward.nodewise = exact > 1
    forward.most_rows = most_rows if forward.nodewise else None
    if forward.nodewise:
        if exact < widest:
            warnings.warn(f"{name}: drafts are cut to {exact - 1} tokens, the most verified exactly ({reason})",
                          stacklevel=3)  # fmt: skip
        return "chain", exact
    dtype = str(forward.model.dtype).removeprefix("torch.")
    warnings.warn(
        f"{name} in {dtype}: drafts are verified in wider passes than plain decoding's, which round {dtype} "
        f"otherwise ({reason}), so where its top two logits tie an output may differ from plain decoding's; load "
        "the model in float32 for output identical to it",
        stacklevel=3,
    )
    return mode, widest


def _nodewise_widths(forward: ModelForward, widest: int) -> tuple[int, int | None, str | None]:
    """The widest block up to `widest` that verified node by node rounds as one-token steps do, every narrower one
    too (1: none does); the most rows a packed product may take for that (None: the model's own layers, which
    cannot be split); and why the next width does not (None if `widest` does)."""
    if has_sliding_layers(forward.new_cache()):
        return 1, None, "node by node attention does not model sliding windows"
    attention = getattr(forward.config, "_attn_implementation", None)
    if attention != "sdpa":
        return 1, None, f"node by node attention runs on SDPA attention, this model's is {attention}"
    chosen = forward.nodewise, forward.most_rows
    forward.nodewise, forward.most_rows = True, None
    try:
        exact, reason = _bit_exact_widths(forward, widest)
        if forward.linears is None or exact == 1:
            return exact, None, reason
        forward.most_rows = exact  # a wider pass in products no wider than the widest exact one
        if exact < widest and _bit_exact_widths(forward, widest, narrowest=exact + 1) == (widest, None):
            return widest, exact, None
        return exact, exact, reason
    except Exception as err:  # a model may refuse a pass outright: that too means "not node by node"
        return 1, None, f"{type(err).__name__}: {err}"
    finally:
        forward.nodewise, forward.most_rows = chosen


def _bit_exact_widths(forward: ModelForward, widest: int, narrowest: int = 2) -> tuple[int, str | None]:
    """`_nodewise_widths` measured: chains of every width from `narrowest` after a prefix, each node's logits against
    the one-token steps over the same tokens, bit for bit; then the step after keeping half the widest exact chain.
    The widest exact width (`narrowest` - 1 if none), and why the next one is not (None: `widest` is exact)."""
    vocab = forward.vocab_size
    prefix = [(7 * i + 3) % vocab for i in range(_BITS_PREFIX)]
    tokens = [(11 * i + 5) % vocab for i in range(widest)]
    with torch.inference_mode():
        cache = _prefilled(forward, prefix)
        steps = [forward(cache, [token], len(prefix) + i, DraftTree())[-1] for i, token in enumerate(tokens)]
        cache.crop(-widest)
        exact, reason = narrowest - 1, None
        for width in range(narrowest, widest + 1):
            got = forward(cache, tokens[:width], len(prefix), DraftTree.chain(tokens[1:width]))
            cache.crop(-width)
            differs = next((index for index in range(width) if not torch.equal(got[index], steps[index])), None)
            if differs is not None:
                reason = f"node {differs} of a chain of {width} rounds otherwise than its one-token step"
                break
            exact = width
        if exact > 1:
            forward(cache, tokens[:exact], len(prefix), DraftTree.chain(tokens[1:exact]))
            kept = exact // 2
            BatchCache(cache, [len(prefix)], [None]).keep([list(range(kept))], exact)
            if not torch.equal(forward(cache, [tokens[kept]], len(prefix) + kept, DraftTree())[-1], steps[kept]):
                return 1, f"the step after keeping {kept} of a chain of {exact} rounds otherwise than plain decoding"
    return exact, reason


def _draft_mode(forward: ModelForward) -> tuple[DraftMode, str | None]:
    """The mode, and the warning a fallback gives."""
    name = type(forward.model).__name__
    reasons = []
    for mode, tree in (("tree", _TREE), ("chain", _CHAIN)):
        try:
            reason = _mismatch(forward, tree)
        except Exception as err:  # a model may refuse a 4-D mask outright: that too means "not this mode"
            reason = f"{type(err).__name__}: {err}"
        if reason is None:
            fallback = f"{name}: tree drafts fall back to single paths ({reasons[0]})" if reasons else None
            return mode, fallback  # type: ignore[return-value]
        reasons.append(reason)
    return "off", (f"{name}: drafting is off, this model verifies neither trees ({reasons[0]}) nor paths "
                   f"({reasons[1]}); decoding is plain")  # fmt: skip


def _prefilled(forward: ModelForward, prefix: list[int]) -> Cache:
    cache = forward.new_cache()
    forward(cache, prefix, 0)
    return cache


def _batch_mismatch(forward: ModelForward, shape: DraftTree, layout: Layout) -> str | None:
    """Why two rows of different lengths verified together (in `layout`, a draft of `shape` on one) differ from each
    row alone — in any bit where `forward.nodewise`, else beyond float noise; None if they do not. Packed rows are
    checked with their drafts attended in one call with the roots and in calls of their own (both run)."""
    if layout != "packed":
        return _rows_mismatch(forward, shape, layout)
    prior = forward.one_call
    try:
        for one_call in (True, False):
            forward.one_call = one_call
            if (why := _rows_mismatch(forward, shape, layout)) is not None:
                return f"{why} ({'in one call' if one_call else 'in calls of their own'})"
    finally:
        forward.one_call = prior
    return None


def _rows_mismatch(forward: ModelForward, shape: DraftTree, layout: Layout) -> str | None:
    vocab = forward.vocab_size
    trees = [DraftTree([t % vocab for t in shape.tokens], shape.parents), DraftTree([_NEXT % vocab], [0])]
    prefixes = [[t % vocab for t in _PREFIX], [t % vocab for t in _PREFIX[:3]]]
    blocks = [[_ROOT % vocab, *tree.tokens] for tree in trees]
    deepest = [[0, *_ancestors(tree, len(tree))] for tree in trees]
    after = (_NEXT + 1) % vocab
    tree_masks = not shape.is_chain
    with torch.inference_mode():
        parts = [BatchCache(_prefilled(forward, prefix), [len(prefix)], [row]) for row, prefix in enumerate(prefixes)]
        batch = SlabCache.merge(parts) if layout == "packed" else BatchCache.merge(parts)
        got = forward.rows(batch.cache, blocks, trees, batch.lengths, tree_masks)
        batch.keep(deepest, max(map(len, blocks)))
        steps = [DraftTree(), DraftTree()]  # as the engine's steps pass them
        got_after = forward.rows(batch.cache, [[after], [after]], steps, batch.lengths, tree_masks)
        for row, (prefix, block, tree, path) in enumerate(zip(prefixes, blocks, trees, deepest, strict=True)):
            alone = _prefilled(forward, prefix)
            want = forward(alone, block, len(prefix), tree)
            if (how := _difference(forward, got[row][: len(block)], want)) is not None:
                return f"row {row} of a batch differs from the same row alone {how}"
            BatchCache(alone, [len(prefix)], [row]).keep([path], len(block))
            want = forward(alone, [after], len(prefix) + len(path), DraftTree())[-1]
            if (how := _difference(forward, got_after[row][0], want)) is not None:
                return f"row {row} of a batch after compacting differs from the same row alone {how}"
    return None


def _difference(forward: ModelForward, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How `got` differs from `want`: in any bit where chains are verified node by node, else beyond float noise."""
    if forward.nodewise:
        return None if torch.equal(got, want) else "in its bits"
    gap = _gap(got, want)
    return None if gap is None else f"by {gap:.3g}"


def probe_batching(forward: ModelForward, mode: DraftMode) -> Layout | None:
    """How generations of different lengths can be verified in one forward pass; None (with a warning why) if not.

    "packed" (decoding/slab.py) where the model takes it, else "padded" (a warning says why
    not packed); without either, a batch of generations is verified one generation at a
    time: still exact, only slower.
    """
    question = f"batching {mode}"
    if forward.nodewise:  # then compared bit for bit, with these pieces
        question += f" node by node, products of {forward.most_rows} rows, {torch.get_num_threads()} threads"
    layout, warning = _once(forward, question, lambda: _layout(forward, mode))
    if warning is not None:
        warnings.warn(f"{type(forward.model).__name__}: {warning}", stacklevel=3)
    return layout


def _layout(forward: ModelForward, mode: DraftMode) -> tuple[Layout | None, str | None]:
    """The layout, and the warning a fallback gives."""
    if mode == "off":
        return None, "generations are verified one at a time, not batched (it verifies no drafts, not even paths)"
    unfit = {}
    if has_sliding_layers(forward.new_cache()):
        unfit["padded"] = "its sliding-window layers keep one length for all rows"
    attention = getattr(forward.config, "_attn_implementation", None)
    if attention != "sdpa":  # PACKED_SDPA stands in for SDPA only (attention.attention_as)
        unfit["packed"] = f"packed batches run on SDPA attention, this model's is {attention}"
    if forward.nodewise:  # the padded layout's rows share one attention call: never a one-token step's bits
        unfit["padded"] = "rows padded to the widest round otherwise than each row alone"
        if forward.most_rows is None:
            unfit["packed"] = (
                "the model's own linear layers cannot make a batch's products in pieces that round as one row's"
            )
    shape = _CHAIN if mode == "chain" or forward.nodewise else _TREE
    reasons = {}
    for layout in ("packed", "padded") if mode == "tree" else ("padded",):
        if layout in unfit:
            reasons[layout] = unfit[layout]
            continue
        try:
            reasons[layout] = _batch_mismatch(forward, shape, layout)
        except Exception as err:  # a model may refuse the layout outright: that too means "not this one"
            reasons[layout] = f"{type(err).__name__}: {err}"
        if reasons[layout] is None:
            packed = reasons.get("packed")
            return layout, None if packed is None else f"batched rows are padded to the widest, not packed ({packed})"
    why = "; ".join(f"{layout}: {reason}" for layout, reason in reasons.items())
    return None, f"generations are verified one at a time, not batched ({why})"
