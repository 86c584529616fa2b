"""The direct decoder's layers in one call of compiled code (layerloop.cpp), where a pass allows it.

A step of a small model on a CPU runs a few hundred small operators besides its products, and
from Python each call costs more than the operator does. The compiled loop makes the calls the
direct decoder's Python loop makes (decoder.py) — the same operators, views, weights and row
kernel products, in the same order — so it reaches the same bits without the interpreter between
them; the check at start (capability.check_direct_decoder) holds it to the model's logits bit for
bit, as it does the Python loop.

It takes a pass only where the Python loop would make exactly those calls: float32, at most
JOIN_ROWS tokens, every product the row kernel's (q/k/v and gate/up joined), attention reading
grouped heads in place; one row on a cache of RoomLayers with room for its block
(attention.head_by_head: one SDPA call), or a packed batch on its slab (attention.packed_calls:
the calls attention.packed_sdpa_forward makes, without sliding windows or token-by-token reads).
Anything else (a prompt, low precision, another attention) runs the Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple

import torch
from transformers import Cache, DynamicCache, PretrainedConfig

from . import rowkernel
from .attention import GROUPED_SDPA, PACKED_SDPA, head_by_head, packed_calls
from .kvcache import RoomLayer
from .linears import JOIN_ROWS, PackedLinears
from .slab import Packing, SlabCache


class LoopLayer(NamedTuple):
    """The modules of one decoder layer that the loop reads weights from, and the cache layer it writes."""

    index: int
    input_norm: torch.nn.Module
    attention: torch.nn.Module
    qkv: tuple[torch.nn.Linear, ...]
    o: tuple[torch.nn.Linear]
    post_norm: torch.nn.Module
    gate_up: tuple[torch.nn.Linear, ...]
    down: tuple[torch.nn.Linear]


class LayerLoop:
    """A block (one row's, or a packed batch's) through every layer in one call; build with `of`."""

    def __init__(self, kernel: ModuleType, layers: Sequence[LoopLayer], config: PretrainedConfig) -> None:
        self._kernel = kernel
        self._layers = layers
        first = layers[0]
        self._shape = (config.num_attention_heads, config.num_key_value_heads, first.attention.head_dim)
        self._scaling = float(first.attention.scaling)
        self._eps = float(first.input_norm.variance_epsilon)
        self._modules = [
            module
            for layer in layers
            for module in (layer.input_norm, *layer.qkv, *layer.o, layer.post_norm, *layer.gate_up, *layer.down)
        ]
        """The modules whose weights and biases the loop reads: what `_params` depends on."""
        self._made: tuple[tuple[int, int], object, bool] | None = None
        """The last weights made for the loop, held by the compiled code with where they were made from (and whether
        they are usable: every product the kernel's), and what else they depend on: the packed layers and the thread
        count."""

    @classmethod
    def of(cls, layers: Sequence[LoopLayer], config: PretrainedConfig) -> LayerLoop | None:
        """A loop for these layers where the compiled code is built and they are what it computes: grouped query
        heads, q/k/v and gate/up of the sizes it splits them by, a SiLU-gated MLP (the caller checks the activation
        module), one scaling and one epsilon throughout; else None."""
        kernel = rowkernel.load()
        if kernel is None or not layers or getattr(config, "hidden_act", None) != "silu":
            return None
        first = layers[0]
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, first.attention.head_dim
        alike = all(
            getattr(layer.attention, "num_key_value_groups", 1) > 1
            and tuple(module.out_features for module in layer.qkv) == (heads * dim, kv_heads * dim, kv_heads * dim)
            and len(layer.gate_up) == 2
            and layer.gate_up[0].out_features == layer.gate_up[1].out_features
            and layer.attention.scaling == first.attention.scaling
            and layer.attention.head_dim == first.attention.head_dim
            and layer.input_norm.variance_epsilon
            == layer.post_norm.variance_epsilon
            == first.input_norm.variance_epsilon
            for layer in layers
        )
        return cls(kernel, layers, config) if alike else None

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Cache,
        linears: PackedLinears | None,
        implementation: str,
        attention_kwargs: dict,
    ) -> torch.Tensor | None:
        """The hidden states after the last layer, the block's keys and values written to `cache`; None (nothing
        done) where the Python loop would make other calls. `attention_kwargs`: what the pass gives attention beyond
        the model's own keywords (a packed batch's packing)."""
        rows, width, _ = hidden.shape
        if (
            rows != 1
            or width > JOIN_ROWS
            or width > rowkernel.MOST_ROWS
            or hidden.dtype != torch.float32
            or linears is None
            or getattr(cache, "offloading", False)
        ):
            return None
        if type(cache) is DynamicCache and not attention_kwargs and implementation == GROUPED_SDPA:
            return self._one_row(hidden, cos, signed_sin, mask, cache, linears)
        packing = attention_kwargs.get("lookahead_packing")
        if isinstance(cache, SlabCache) and set(attention_kwargs) == {"lookahead_packing"} and packing is not None:
            return self._packed(hidden, cos, signed_sin, cache, packing, linears, implementation)
        return None

    def _one_row(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        mask: torch.Tensor | None,
        cache: DynamicCache,
        linears: PackedLinears,
    ) -> torch.Tensor | None:
        """One row's block on its RoomLayers, where each has room for it and attention is one SDPA call."""
        width = hidden.shape[1]
        rooms = self._rooms(cache, width)
        params = self._params(linears) if rooms is not None else None
        if params is None:
            return None
        keys, values = rooms
        if not head_by_head(self._layers[0].attention, width, mask is not None, keys[0], values[0]):
            return None
        heads, kv_heads, dim = self._shape
        length = cache.layers[self._layers[0].index].get_seq_length()
        hidden = self._kernel.decoder_layers(
            hidden, cos, signed_sin, mask, params, keys, values, length, self._eps, self._scaling, heads, kv_heads, dim
        )
        for layer in self._layers:
            cache.layers[layer.index].advance(width)
        return hidden

    def _packed(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        cache: SlabCache,
        packing: Packing,
        linears: PackedLinears,
        implementation: str,
    ) -> torch.Tensor | None:
        """A packed batch's blocks (decoding/slab.py), attended as attention.packed_sdpa_forward attends them."""
        if (
            implementation != PACKED_SDPA
            or cache.packing is not packing  # (the packing SlabLayer.update would write by)
            or any(layer.window is not None for layer in cache.layers)
        ):
            return None
        heads, kv_heads, dim = self._shape
        keys = [cache.layers[layer.index].keys for layer in self._layers]
        values = [cache.layers[layer.index].values for layer in self._layers]
        shapes = {(*states.shape[1:2], states.shape[-1], states.dtype) for states in (*keys, *values)}
        if shapes != {(kv_heads, dim, torch.float32)} or packing.end > keys[0].shape[-2]:
            return None
        calls = packed_calls(self._layers[0].attention, packing, keys[0])
        params = self._params(linears) if calls is not None else None
        if params is None:
            return None
        return self._kernel.packed_decoder_layers(
            hidden, cos, signed_sin, params, keys, values, packing.rows, packing.columns, packing.end, self._eps,
            self._scaling, heads, kv_heads, dim, *calls,
        )  # fmt: skip

    def _rooms(self, cache: Cache, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Each layer's key and value rooms, where every layer has room for the block after as many entries."""
        _, kv_heads, dim = self._shape
        keys, values, lengths = [], [], set()
        for layer in self._layers:
            held = cache.layers[layer.index] if layer.index < len(cache.layers) else None
            if type(held) is not RoomLayer:
                return None
            rooms = held.room_for(width, (1, kv_heads, dim), torch.float32, torch.device("cpu"))
            if rooms is None:
                return None
            keys.append(rooms[0])
            values.append(rooms[1])
            lengths.add(held.get_seq_length())
        return (keys, values) if len(lengths) == 1 else None

    def _params(self, linears: PackedLinears) -> object | None:
        """The weights as the Python loop would multiply by them in this pass, in layerloop.cpp's order, held by the
        compiled code (handing them over every pass costs more than the pass's norms): made again only after a
        weight or bias was replaced in its module, moved or changed in place, or the thread count changed (what
        PackedLinears checks for each product); None where some product is not the kernel's."""
        depends = (id(linears), torch.get_num_threads())
        if self._made is None or self._made[0] != depends or not self._made[1].current():
            holders = [module._parameters for module in self._modules for _ in ("weight", "bias")]
            params = self._weights(linears)
            weights = self._kernel.LoopWeights(params or [], holders, ["weight", "bias"] * len(self._modules))
            self._made = (depends, weights, params is not None)
        return self._made[1] if self._made[2] else None  # a None kept too: not looked for again every pass

    def _weights(self, linears: PackedLinears) -> list[torch.Tensor | None] | None:
        """The weights and biases, joined as the Python loop joins them; None where a product is not the kernel's."""
        params: list[torch.Tensor | None] = []
        for layer in self._layers:
            products = [linears.row_weights(modules) for modules in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(product is None for product in products):
                return None
            (qkv, qkv_bias), (o, o_bias), (gate_up, gate_up_bias), (down, down_bias) = products
            params += [layer.input_norm.weight, qkv, qkv_bias, o, o_bias, layer.post_norm.weight, gate_up,
                       gate_up_bias, down, down_bias]  # fmt: skip
        return params
