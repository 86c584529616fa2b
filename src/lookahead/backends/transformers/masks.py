"""Input ids, attention masks and position ids for blocks verified after cached tokens, on the model's device.

One row with a single path (or no draft, or a prompt) uses the ordinary causal mask, which
every model supports. A branching tree needs a 4-D additive mask: every block entry sees the
row's cache and, within the block, only its own ancestors; positions go by depth. Several
rows (left-aligned, of different lengths, the block appended at the longest row's length)
need each row's gap hidden: a 4-D mask for tree-capable models, a 2-D padding mask for
chain-only ones (ALiBi models read positions off it). Only the block's own part comes from
the host; the cache columns are filled on the device, so a step's host work does not grow
with the context. Every query row sees at least one key (its own entry), so none is NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ...drafting.tree import DraftTree
from .slab import Draft, OneCall, Packing

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""input_ids (B, Q), attention_mask (2-D or 4-D), position_ids (B, Q)."""
ONE_CALL_KEYS = {True: 4_000, False: 1_500}
"""Padded queries x keys that one attention call saved is worth, where blocks are 3 or more tokens wide (a packed
batch's drafts in one call with its roots, OneCall), by whether the pass attends each group of query heads as one head
(attention._torch_sdpa, where measured faster), which makes padded queries cheaper; benchmarks/NOTES.md has the passes
each was fitted to."""


def tree_mask(tree: DraftTree, past: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive (1, 1, n+1, past+n+1): 0 where attention is allowed, dtype's min elsewhere.

    Float, not boolean: boolean 4-D masks are mishandled by eager attention in transformers 5.
    """
    size = len(tree) + 1
    hidden = torch.from_numpy(~tree.ancestor_matrix()).to(device)
    mask = torch.zeros((1, 1, size, past + size), dtype=dtype, device=device)
    mask[0, 0, :, past:].masked_fill_(hidden, torch.finfo(dtype).min)
    return mask


def tree_positions(tree: DraftTree, past: int, device: torch.device | str) -> torch.Tensor:
    """Positions (1, n+1) of the block: the root at `past`, each node one below its parent."""
    depths = torch.tensor([0, *tree.depths], dtype=torch.long)
    return (depths + past).to(device).unsqueeze(0)


def causal_inputs(past: int, size: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D all-ones mask and consecutive positions of `size` tokens after `past`."""
    mask = torch.ones((1, past + size), dtype=torch.long, device=device)
    positions = torch.arange(past, past + size, device=device).unsqueeze(0)
    return mask, positions


def block_inputs(
    blocks: Sequence[Sequence[int]],
    trees: Sequence[DraftTree | None],
    lengths: Sequence[int],
    tree_masks: bool,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Inputs:
    """Inputs of row b's `blocks[b]` (its root, then `trees[b]`'s nodes; None: a plain run of tokens).

    `lengths[b]` entries of row b are cached; the block goes at the longest row's length.
    `tree_masks` False: the model takes only 2-D masks, so every row's block must be a path.
    """
    past = max(lengths)
    if len(blocks) == 1:
        ids = torch.tensor([list(blocks[0])], dtype=torch.long, device=device)
        tree = trees[0]
        if tree is not None and not tree.is_chain:
            return ids, tree_mask(tree, past, dtype, device), tree_positions(tree, past, device)
        return ids, *causal_inputs(past, len(blocks[0]), device)
    width = max(map(len, blocks))
    ids = torch.tensor([[*block, *[block[0]] * (width - len(block))] for block in blocks], dtype=torch.long)
    depths = np.zeros((len(blocks), width), dtype=np.int64)
    for row, tree in enumerate(trees):
        depths[row, : len(blocks[row])] = [0, *tree.depths] if tree is not None else range(len(blocks[row]))
        if not tree_masks:
            depths[row, len(blocks[row]) :] = range(len(blocks[row]), width)
    cached = torch.tensor(lengths, dtype=torch.long, device=device)
    positions = torch.from_numpy(depths).to(device) + cached[:, None]
    seen = torch.arange(past, device=device)[None, :] < cached[:, None]  # each row's own entries, not its gap
    if not tree_masks:
        real = torch.arange(width)[None, :] < torch.tensor([len(block) for block in blocks])[:, None]
        return ids.to(device), torch.cat([seen, real.to(device)], dim=1).long(), positions
    within = np.zeros((len(blocks), width, width), dtype=bool)
    for row, (block, tree) in enumerate(zip(blocks, trees, strict=True)):
        size = len(block)
        within[row, :size, :size] = tree.ancestor_matrix() if tree is not None else np.tri(size, dtype=bool)
        within[row, range(size, width), range(size, width)] = True  # padding sees itself only
    allowed = torch.cat([seen[:, None, :].expand(-1, width, -1), torch.from_numpy(within).to(device)], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return ids.to(device), mask[:, None], positions


def packed_inputs(
    blocks: Sequence[Sequence[int]],
    trees: Sequence[DraftTree | None],
    lengths: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    window: int | None = None,
    sliding_layers: frozenset[int] = frozenset(),
    nodewise: bool = False,
    one_call: bool = True,
    groups_as_heads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """input_ids and position_ids (1, T) of the rows' blocks packed, each after its row's `lengths[b]` entries.

    The packing (slab.py) says where each token is written and holds the masks attention
    reads per row: the roots' (every row's root sees its row's entries and itself) and each
    drafting row's (its nodes see the row's entries, the root and their own ancestors). With
    a sliding `window`, the same masks again for `sliding_layers`, each query seeing only the
    keys fewer than `window` positions before its own (a row's entry at column c has position c).
    `nodewise` (chains only): every token reads its row's entries up to its own, on its own (Packing.token_reads).
    `one_call`: drafts may attend in one padded call with the roots where that is cheaper (Packing.one_call; how much
    cheaper depends on `groups_as_heads`, the way the pass attends grouped query heads).
    """
    ids = torch.tensor([[token for block in blocks for token in block]], dtype=torch.long, device=device)
    depths, rows, columns, roots, drafts, seen_by_nodes = [], [], [], [], [], []
    for row, (block, tree, length) in enumerate(zip(blocks, trees, lengths, strict=True)):
        size = len(block)
        start = len(depths)
        depths += [length + depth for depth in _depths(block, tree)]
        rows += [row] * size
        columns += range(length, length + size)
        roots.append(start)
        if size > 1:
            within = tree.ancestor_matrix() if tree is not None else np.tri(size, dtype=bool)
            allowed = np.ones((size - 1, length + size), dtype=bool)
            allowed[:, length:] = within[1:]
            seen_by_nodes.append(allowed)
            mask = _additive(allowed, dtype, device)[None, None]
            windowed = None
            if window is not None:
                keys = np.concatenate([np.arange(length), depths[start:]])  # each key's position
                near = np.asarray(depths[start + 1 :])[:, None] - keys[None, :] < window
                windowed = _additive(allowed & near, dtype, device)[None, None]
            drafts.append(Draft(row, start + 1, size - 1, mask, windowed))
    end = max(length + len(block) for length, block in zip(lengths, blocks, strict=True))
    cached = torch.tensor(lengths)[:, None]
    seen = torch.arange(end)[None, :] <= cached  # the row's entries and its root
    root_mask = _additive(seen.numpy(), dtype, device)[:, None, None]
    window_root_mask = None
    if window is not None:
        near = cached - torch.arange(end)[None, :] < window
        window_root_mask = _additive((seen & near).numpy(), dtype, device)[:, None, None]
    as_tensors = (torch.tensor(values, dtype=torch.long, device=device) for values in (rows, columns, roots))
    sliding = sliding_layers if window is not None else frozenset()
    reads = None
    if nodewise:
        if any(tree is not None and not tree.is_chain for tree in trees):
            raise ValueError("drafts verified token by token must be chains")
        reads = tuple((row, column + 1) for row, column in zip(rows, columns, strict=True))
    together = None
    sizes = [len(block) for block in blocks]
    keys_a_call = ONE_CALL_KEYS[groups_as_heads]
    if one_call and drafts and window is None and not nodewise and _one_call_pays(sizes, lengths, end, keys_a_call):
        together = _one_call(sizes, roots, seen.numpy(), drafts, seen_by_nodes, dtype, device)
    packing = Packing(*as_tensors, root_mask, tuple(drafts), end, window_root_mask, sliding, reads, together)
    return ids, torch.tensor([depths], dtype=torch.long, device=device), packing


def _one_call_pays(sizes: Sequence[int], lengths: Sequence[int], end: int, keys_a_call: int) -> bool:
    """Whether the rows' blocks padded to the widest cost less in one attention call (every query over all `end`
    columns) than the roots' call and one call per drafting row (its nodes over its own row's columns). Measured on a
    CPU (other devices take the same rule, unmeasured): blocks of at most two tokens always do (a second query a row
    costs torch's attention next to nothing); wider ones where the reads one call adds — padded queries', and
    drafting rows' nodes past their own row's columns — are at most `keys_a_call` for each call saved."""
    width = max(sizes)
    padding = len(sizes) * width - sum(sizes)
    beyond = sum((size - 1) * (end - length - size) for size, length in zip(sizes, lengths, strict=True) if size > 1)
    return width <= 2 or padding * end + beyond <= keys_a_call * sum(size > 1 for size in sizes)


def _one_call(
    sizes: Sequence[int],
    roots: Sequence[int],
    seen_by_roots: np.ndarray,
    drafts: Sequence[Draft],
    seen_by_nodes: Sequence[np.ndarray],
    dtype: torch.dtype,
    device: torch.device | str,
) -> OneCall:
    """The rows' blocks padded to the widest for one call: each query sees what it would in the roots' call (a root,
    and padding, as its row's root) or in its row's call (a node); padded places repeat the row's root."""
    width = max(sizes)
    allowed = np.repeat(seen_by_roots[:, None, :], width, axis=1)  # (rows, width, end)
    for draft, seen in zip(drafts, seen_by_nodes, strict=True):
        allowed[draft.row, 1 : draft.size + 1] = False
        allowed[draft.row, 1 : draft.size + 1, : seen.shape[1]] = seen
    gather = [root + place if place < size else root for root, size in zip(roots, sizes, strict=True)
              for place in range(width)]  # fmt: skip
    scatter = [row * width + place for row, size in enumerate(sizes) for place in range(size)]
    as_tensors = (torch.tensor(values, dtype=torch.long, device=device) for values in (gather, scatter))
    return OneCall(*as_tensors, width, _additive(allowed, dtype, device)[:, None])


def _additive(allowed: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An additive mask: 0 where `allowed`, dtype's min elsewhere."""
    hidden = torch.from_numpy(~allowed).to(device)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)


def _depths(block: Sequence[int], tree: DraftTree | None) -> Sequence[int]:
    return [0, *tree.depths] if tree is not None else range(len(block))
