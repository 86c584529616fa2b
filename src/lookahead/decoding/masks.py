"""Attention masks and position ids for a block verified after `past` cached tokens, on the model's device.

A branching tree needs a 4-D additive mask: every block entry sees the whole cache and,
within the block, only its own ancestors; and positions by depth. Only the block's own
(n+1) x (n+1) part comes from the tree and crosses to the device; the cache columns are
filled on the device, so a step's host work does not grow with the context. A single path
(or no draft) uses the ordinary causal mask, which every model supports.
"""

from __future__ import annotations

import torch

from ..drafting.tree import DraftTree


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
