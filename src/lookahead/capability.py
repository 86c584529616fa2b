"""Does this model honour a custom tree mask? Checked once, by comparison with sequential decoding.

Some architectures derive positions or biases from a 2-D padding mask (OPT, ALiBi models)
and silently misread a 4-D one. Rather than keep a list of names, we run a tiny tree through
the model and compare every node's logits with the plain causal computation of its path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from .draft import DraftTree
from .kvcache import keep_accepted, new_cache

if TYPE_CHECKING:
    from .engine import LookaheadEngine

# root r; nodes a, b under r; c under a; d under c: paths r-a-c-d and r-b.
_TREE = DraftTree(tokens=[11, 12, 13, 14], parents=[0, 0, 1, 3])
_CHAIN = DraftTree(tokens=[11, 13, 14], parents=[0, 1, 2])
_PREFIX = [5, 6, 7, 8, 9, 10]
_ROOT = 4
_NEXT = 15


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tolerance = 1e-3 if got.dtype == torch.float32 else 5e-2
    scale = max(1.0, float(want.abs().max()))
    return bool(torch.allclose(got.float(), want.float(), rtol=0, atol=tolerance * scale))


def _plain_logits(engine: LookaheadEngine, tokens: list[int]) -> torch.Tensor:
    """Logits of a fresh causal forward over `tokens`."""
    return engine.forward(new_cache(engine.model), tokens, 0)


def _passes(engine: LookaheadEngine, tree: DraftTree) -> bool:
    """Tree logits equal path logits, and the compacted cache continues like a plain one."""
    vocab = engine.model.config.vocab_size
    tokens = [t % vocab for t in tree.tokens]
    tree = DraftTree(tokens, tree.parents)
    prefix = [t % vocab for t in _PREFIX]
    root, nxt = _ROOT % vocab, _NEXT % vocab
    with torch.inference_mode():
        cache = new_cache(engine.model)
        engine.forward(cache, prefix, 0)
        got = engine.forward(cache, [root, *tokens], len(prefix), tree)
        block_paths: list[list[int]] = [[root]]
        for token, parent in zip(tokens, tree.parents, strict=True):
            block_paths.append([*block_paths[parent], token])
        for index, path in enumerate(block_paths):
            want = _plain_logits(engine, prefix + path)[-1]
            if not _close(got[index], want):
                return False
        kept = max(range(len(block_paths)), key=lambda i: len(block_paths[i]))
        accepted = _ancestors(tree, kept)
        keep_accepted(cache, len(tokens) + 1, accepted)
        got_next = engine.forward(cache, [nxt], len(prefix) + len(accepted) + 1)[-1]
        want_next = _plain_logits(engine, prefix + block_paths[kept] + [nxt])[-1]
        return _close(got_next, want_next)


def _ancestors(tree: DraftTree, index: int) -> list[int]:
    """Block indices from the root's child down to `index`."""
    path = []
    while index:
        path.append(index)
        index = tree.parents[index - 1]
    return path[::-1]


def check_cached_decoding(engine: LookaheadEngine) -> None:
    """Raise if a cached step differs from a fresh forward: plain decoding itself would be wrong.

    This catches a model (or transformers version) that silently ignores the cache it is given.
    """
    vocab = engine.model.config.vocab_size
    prefix, root = [t % vocab for t in _PREFIX], _ROOT % vocab
    with torch.inference_mode():
        cache = new_cache(engine.model)
        engine.forward(cache, prefix, 0)
        got = engine.forward(cache, [root], len(prefix))[-1]
        want = _plain_logits(engine, [*prefix, root])[-1]
    if not _close(got, want):
        raise RuntimeError(
            f"{type(engine.model).__name__} does not continue from the cache the engine passes it: "
            "this model or transformers version is not supported"
        )


def probe_draft_mode(engine: LookaheadEngine) -> Literal["tree", "chain", "off"]:
    """'tree' if branching drafts verify exactly, else 'chain' if single paths do, else 'off'."""
    check_cached_decoding(engine)
    for mode, tree in (("tree", _TREE), ("chain", _CHAIN)):
        try:
            if _passes(engine, tree):
                return mode  # type: ignore[return-value]
        except Exception:
            continue
    return "off"
