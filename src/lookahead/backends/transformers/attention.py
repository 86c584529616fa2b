"""Masked attention over a block of several tokens without copying the KV cache for every query head.

transformers' SDPA attention, given a mask and more than one query token, repeats each
key/value head for its group of query heads (`repeat_kv`) before calling torch: on a model
with grouped-query attention that copies the whole cache of every layer, every step. A
verification block always has a mask and several tokens, so on a CPU the copy made a draft
grow dearer with the context, most on models with few key/value heads (benchmarks/NOTES.md,
"Verification blocks read grouped key/value heads in place"). torch's SDPA takes the groups
itself (`enable_gqa`), with the mask, on the CPU, and gives the same bits; in rows of a batch
this module hands it each group as one head instead (`_torch_sdpa`), where that was measured faster
(kernels.groups_as_heads). transformers keeps the copy on other devices
(there a mask with `enable_gqa` falls back to the slow kernel), and so do we.

The grouped function is registered in transformers' attention registry under
GROUPED_SDPA and used for this engine's forward passes only (`ModelForward`); one query
without a mask (a one-token step) calls torch's SDPA directly where transformers would make
that very call, and every other case is handed to transformers' own SDPA function unchanged.
PACKED_SDPA wraps it for packed batches (decoding/slab.py), whose queries it unpacks per row
around the call.

NODEWISE_SDPA is for a chain verified in bfloat16 or float16 (capability.settle_rounding): one
call per node over exactly the keys that node's one-token step reads, so each node's attention
is the very call plain decoding makes, with the same bits; one call for the whole block rounds
otherwise and can flip a near-tie.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.integrations import sdpa_attention
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .slab import Packing

_GQA_RULE = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
"""transformers' rule for reading grouped heads in place in its SDPA function (host and mask dependent)."""
_GQA_RULE_TAKES_VALUE = (
    _GQA_RULE is not None and len(inspect.signature(_GQA_RULE).parameters) >= 3
)  # (mask, key) before

GROUPED_SDPA = "lookahead_grouped_sdpa"
PACKED_SDPA = "lookahead_packed_sdpa"
NODEWISE_SDPA = "lookahead_nodewise_sdpa"

_GROUPS_AS_HEADS: ContextVar[bool] = ContextVar("lookahead_groups_as_heads", default=True)
"""Whether a batch's blocks attend each group of query heads as one head in the pass now running (`_torch_sdpa`;
set by `attention_as` from ModelForward.groups_as_heads, which kernels.groups_as_heads measures)."""


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked block of several queries reads grouped heads in place, and
    that one query without a mask (a one-token step) calls torch's SDPA directly, as transformers would."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if attention_mask is not None and query.shape[2] > 1 and grouped and _in_place(module, query, kwargs):
        return _torch_sdpa(module, query, key, value, attention_mask, dropout, scaling), None
    if attention_mask is None and _lone_query(module, query, key, value, kwargs):
        return _torch_sdpa(module, query, key, value, None, dropout, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def nodewise_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A chain appended to the cache (its block's keys last), node by node: node i over the cache and nodes 0..i.

    Each node's call is the one its one-token step makes (one-token steps come here too), so each node's row is
    the one plain decoding computes. Only for one sequence's chain: the block's own mask is not read.
    """
    width = query.shape[2]
    past = key.shape[2] - width
    return _one_by_one(module, query, key, value, [(0, past + i + 1) for i in range(width)], dropout, scaling, kwargs)


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    lookahead_packing: Packing | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed batch (decoding/slab.py): every row's root in one call, each drafting row's nodes in one
    (or, where the packing says so, every row's block in one call padded to the widest: slab.OneCall).

    The query is (1, heads, T, dim) over the real tokens of every row; the keys and values
    are the slab's (rows, kv heads, columns, dim). A drafting row's nodes read that row's
    keys only (in calls of their own), so no row pays for another's width. A sliding layer reads the packing's window
    masks. Without a packing this is GROUPED_SDPA.
    """
    if lookahead_packing is None:
        return grouped_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packing = lookahead_packing
    if packing.token_reads is not None:  # every token on its own, as NODEWISE_SDPA
        return _one_by_one(module, query, key, value, packing.token_reads, dropout, scaling, kwargs)
    in_place = _in_place(module, query, kwargs)
    sliding = _slides(module, packing, kwargs.get("sliding_window"))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if in_place:
            return _torch_sdpa(module, q, k, v, mask, dropout, scaling)
        return sdpa_attention_forward(module, q, k, v, mask, dropout, scaling, **kwargs)[0]

    flat = query[0].transpose(0, 1)  # (T, heads, dim)
    if packing.one_call is not None:
        call = packing.one_call
        padded = flat.index_select(0, call.gather).view(-1, call.width, *flat.shape[1:]).transpose(1, 2)
        seen = attend(padded, key, value, call.mask)  # (rows, width, heads, dim)
        return seen.reshape(-1, *flat.shape[1:]).index_select(0, call.scatter)[None], None
    output = torch.empty_like(flat)
    roots = flat.index_select(0, packing.roots)[:, :, None]  # (B, heads, 1, dim)
    root_mask = packing.window_root_mask if sliding else packing.root_mask
    output.index_copy_(0, packing.roots, attend(roots, key, value, root_mask)[:, 0])
    for draft in packing.drafts:
        nodes = flat[draft.start : draft.start + draft.size].transpose(0, 1)[None]  # (1, heads, size, dim)
        keys = draft.mask.shape[-1]
        row = slice(draft.row, draft.row + 1)
        seen = attend(nodes, key[row, :, :keys], value[row, :, :keys], draft.window_mask if sliding else draft.mask)
        output[draft.start : draft.start + draft.size] = seen[0]
    return output[None], None


def _one_by_one(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    reads: Sequence[tuple[int, int]],
    dropout: float,
    scaling: float | None,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """Query token t (of batch row 0) attends alone over the first `keys` columns of batch row `row`, (row, keys) =
    `reads[t]`: one call each, as a one-token step's (no mask: a one-token step reading its whole cache has none).

    The engine's one-token steps come here too, so every step and node makes the same call; where torch's SDPA
    takes the layer in place, it is called directly (a node's call is most of what verifying it costs)."""
    if kwargs.get("sliding_window") is not None:
        raise RuntimeError("a sliding-window layer cannot attend token by token: its window is in the masks")

    def wrapped(*args) -> torch.Tensor:  # transformers' function, where torch's cannot take the layer in place
        return grouped_sdpa_forward(*args, **kwargs)[0]

    attend = _torch_sdpa if _in_place(module, query, kwargs) else wrapped
    tokens = [
        attend(module, query[:, :, t : t + 1], key[row : row + 1, :, :keys], value[row : row + 1, :, :keys], None,
               dropout, scaling)
        for t, (row, keys) in enumerate(reads)
    ]  # fmt: skip
    return torch.cat(tokens, dim=1), None


def _slides(module: torch.nn.Module, packing: Packing, window: int | None) -> bool:
    """Whether this layer reads the window masks: its cache layer slid (the slab says), checked with the model.

    The cache's layer types come from the model's config, as transformers' own masks do;
    `window` is what the layer passed (transformers' `sliding_window` keyword), where it does.
    """
    if not packing.sliding_layers:
        if window is not None:
            raise RuntimeError("a sliding-window layer was given a packed batch without window masks")
        return False
    number = getattr(module, "layer_idx", None)
    if number is None:
        raise RuntimeError(f"{type(module).__name__} has no layer index: which layers slide is unknown")
    sliding = number in packing.sliding_layers
    if window is not None and not sliding:
        raise RuntimeError(f"layer {number} slides, yet its cache did not")
    return sliding


def _in_place(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether torch's SDPA takes this layer's grouped heads in place, with a mask: on CPUs, without biases."""
    return query.device.type == "cpu" and kwargs.get("position_bias") is None and kwargs.get("softcap") is None


def _lone_query(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict
) -> bool:
    """One query (given no mask), on a CPU, where transformers' SDPA function makes the very call `_torch_sdpa` does
    (not causal; grouped heads in place where transformers' own rule says it reads them so), after checks that cost
    a one-token step of a small model tens of microseconds."""
    if query.shape[2] != 1 or not _in_place(module, query, kwargs):
        return False
    return getattr(module, "num_key_value_groups", 1) == 1 or _transformers_groups_in_place(key, value)


def _transformers_groups_in_place(key: torch.Tensor, value: torch.Tensor) -> bool:
    """transformers' own answer (`use_gqa_in_sdpa`, without a mask) where this version has it; else False."""
    if _GQA_RULE is None:
        return False
    return bool(_GQA_RULE(None, key, value) if _GQA_RULE_TAKES_VALUE else _GQA_RULE(None, key))


def _torch_sdpa(module, query, key, value, mask, dropout: float, scaling: float | None) -> torch.Tensor:
    """(batch, queries, heads, dim) of torch's SDPA, grouped heads read in place.

    A block of several queries in rows of a batch is handed over with each key/value head's group of query heads as
    one head of `groups` times the queries (`_queries_by_group`): torch's CPU kernel then reads each key/value head
    once for the whole group, where with `enable_gqa` it works head by head, and one or a few queries a head take its
    slow small-matrix path (benchmarks/NOTES.md). The kernel shares its work among threads by row and head, so this is
    done only where each thread still gets two (row, key/value head) pairs or more; one query stays with `enable_gqa`
    too: its call is a one-token step's. A block of two or three queries a head may round otherwise in the last bits
    than head by head, as a block already does against its one-token steps (exactness is of tokens: the tests).
    Where laying the queries and mask out so costs more than the kernel saves (measured: kernels.groups_as_heads),
    the pass says so (`attention_as`) and every call is head by head."""
    groups = getattr(module, "num_key_value_groups", 1)
    if _by_group(groups, query.shape[0], key.shape[1], query.shape[2]):
        batch, heads, queries, dim = query.shape
        output = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(batch, heads // groups, groups * queries, dim), key, value,
            attn_mask=_queries_by_group(mask, groups, heads, queries), dropout_p=dropout, scale=scaling,
        )  # fmt: skip
        return output.view(batch, heads, queries, dim).transpose(1, 2)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
    )
    return output.transpose(1, 2)


def _by_group(groups: int, rows: int, kv_heads: int, queries: int) -> bool:
    """Whether `_torch_sdpa` hands each group of query heads over as one head (see there)."""
    return groups > 1 and queries > 1 and _GROUPS_AS_HEADS.get() and rows * kv_heads >= 2 * torch.get_num_threads()


def head_by_head(module: torch.nn.Module, queries: int, masked: bool, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether GROUPED_SDPA attends one row's block of `queries` queries (with a mask, or none) of this grouped layer on
    a CPU, keys and values like `key` and `value`, by one call of torch's SDPA reading the groups in place head by head
    (`enable_gqa`): the call layerloop.cpp makes in its place (for Llama's families: no biases, no caps)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1 or key.device.type != "cpu":
        return False
    if masked:
        return queries > 1 and not _by_group(groups, 1, key.shape[1], queries)
    return queries == 1 and _transformers_groups_in_place(key, value)


def packed_calls(module: torch.nn.Module, packing: Packing, key: torch.Tensor) -> tuple | None:
    """The calls `packed_sdpa_forward` makes for this packing on a layer like `module` (grouped heads, keys like
    `key`: the slab's), as layerloop.cpp's packed loop takes them: one padded call (gather, scatter, width, mask, the
    mask laid out by group, whether by group), then the roots' call (indices, mask) and each drafting row's (rows,
    starts, sizes, masks, masks by group, whether by group); None where it attends otherwise (token by token, sliding
    windows, another device)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups <= 1 or key.device.type != "cpu" or packing.token_reads is not None or packing.sliding_layers:
        return None
    heads, kv_heads = groups * key.shape[1], key.shape[1]

    def way(mask: torch.Tensor, rows: int, queries: int) -> tuple[torch.Tensor | None, bool]:
        by_group = _by_group(groups, rows, kv_heads, queries)
        return (_queries_by_group(mask, groups, heads, queries) if by_group else None), by_group

    call = packing.one_call
    if call is not None:
        grouped, by_group = way(call.mask, call.gather.numel() // call.width, call.width)
        return (call.gather, call.scatter, call.width, call.mask, grouped, by_group, None, None, [], [], [], [], [], [])
    drafts = packing.drafts
    ways = [way(draft.mask, 1, draft.size) for draft in drafts]
    return (None, None, 0, None, None, False, packing.roots, packing.root_mask, [d.row for d in drafts],
            [d.start for d in drafts], [d.size for d in drafts], [d.mask for d in drafts], [w[0] for w in ways],
            [w[1] for w in ways])  # fmt: skip


def _queries_by_group(mask: torch.Tensor | None, groups: int, heads: int, queries: int) -> torch.Tensor | None:
    """A (batch, 1 or heads, queries, keys) mask for queries laid out as `_torch_sdpa` lays out a group's heads:
    (batch, 1 or key/value heads, groups x queries, keys), the group's heads one after another."""
    if mask is None:
        return None
    mask = mask.expand(*mask.shape[:2], queries, mask.shape[-1])
    if mask.shape[1] == 1:
        return mask.repeat(1, 1, groups, 1)
    return mask.reshape(mask.shape[0], heads // groups, groups * queries, mask.shape[-1])


for _name, _function in (
    (GROUPED_SDPA, grouped_sdpa_forward),
    (PACKED_SDPA, packed_sdpa_forward),
    (NODEWISE_SDPA, nodewise_sdpa_forward),
):
    AttentionInterface.register(_name, _function)
    AttentionMaskInterface.register(_name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # the masks SDPA takes


def grouped_attention(model: PreTrainedModel, device: torch.device) -> str | None:
    """GROUPED_SDPA where it helps this model: SDPA attention with grouped heads, on a CPU; else None."""
    if device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return None
    grouped = any(getattr(module, "num_key_value_groups", 1) > 1 for module in model.modules())
    return GROUPED_SDPA if grouped else None


@contextlib.contextmanager
def attention_as(model: PreTrainedModel, implementation: str | None, groups_as_heads: bool = True) -> Iterator[None]:
    """Within: the model's SDPA attention (its config's and sub-configs') is `implementation` (None changes nothing),
    and a batch's blocks attend each group of query heads as one head only if `groups_as_heads` (`_torch_sdpa`)."""
    grouping = _GROUPS_AS_HEADS.set(groups_as_heads)
    configs = () if implementation is None else _configs(model.config)
    switched = [config for config in configs if config._attn_implementation_internal == "sdpa"]
    for config in switched:
        config._attn_implementation_internal = implementation
    try:
        yield
    finally:
        for config in switched:
            config._attn_implementation_internal = "sdpa"
        _GROUPS_AS_HEADS.reset(grouping)


def _configs(config: PretrainedConfig) -> Iterator[PretrainedConfig]:
    yield config
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            yield from _configs(sub)
