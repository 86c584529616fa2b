"""A Llama-shaped model's decoder stack run as one loop, without transformers' per-layer plumbing.

A one-token step of a small model on a CPU spends a measurable share of its time around the
arithmetic (benchmarks/NOTES.md): module calls that only pass keyword arguments on, and an
RMSNorm written as eight operators. This loop computes the same products and sums on the same
modules and weights — the model's embedding and rotary embedding, its linear layers (packed ones
too: linears.packed_as swaps their forwards; on the model's own layers, torch's `linear` on their
weights, without a module call), its cache's `update`, the attention function the pass is set to
— with fewer operators where that keeps every bit: the norms as torch's one RMSNorm operator, the
rotation as one roll of each head against a sine whose first half is negated (the model's
rotation negates the head's second half instead: the same products), and where packed layers
run, a layer's q/k/v projections, and its gate and up, as one product each on shapes where that
keeps every bit of the separate products (linears.PackedLinears.joined; never on layers with
hooks).
It is used only where a check at start finds it gives the model's logits bit for bit
(capability.check_direct_decoder), so it reaches the same numbers by a shorter road, never other
numbers. Passes on the row kernel (one row's, or a packed batch's) go shorter still: the loop's calls
made from compiled code in one call (layerloop.py), where the pass is one whose calls it makes alike.

Llama-shaped: every decoder layer holds an input norm, attention of q/k/v/o projections, a
post-attention norm and a gated MLP, with full (not sliding) attention — transformers' Llama,
Qwen2 and Mistral classes (SmolLM2 is a Llama). Anything else runs through the model's forward
as before, and so does a model with hooks or a replaced forward on a module the loop does not
call. The modules are looked up when the engine starts: swap a layer afterwards (an adapter
injected, a hook added) and start a new engine.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.modules import module as module_hooks
from transformers import Cache, PretrainedConfig, PreTrainedModel
from transformers.activations import SiLUActivation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...decoding.sampling import first_largest
from . import rowkernel
from .argmaxhead import ArgmaxHead
from .attention import GROUPED_SDPA, NODEWISE_SDPA
from .layerloop import LayerLoop, LoopLayer
from .linears import PackedLinears

_FAMILIES = frozenset(
    f"transformers.models.{name}.modeling_{name}" for name in ("llama", "qwen2", "mistral")
)  # every layer: input norm, q/k/v/o attention, post-attention norm, gated MLP; RMSNorm as Llama's
_UNMASKED_STEPS = frozenset({"sdpa", GROUPED_SDPA, NODEWISE_SDPA})
"""Attention whose mask for one token of one row, nothing padded, is none at all (transformers' SDPA masks, which
ours take)."""
_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
"""What transformers' mask helper calls the cache (renamed during 5.x, as the model's forward's: forward.py)."""


class _Layer(NamedTuple):
    """One decoder layer's modules, looked up once."""

    index: int
    input_norm: torch.nn.Module
    attention: torch.nn.Module
    qkv: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]
    o: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: tuple[torch.nn.Module, torch.nn.Module]
    down: torch.nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]

    joins: bool
    """Whether qkv and gate_up may run as joined products: none of them has hooks or a replaced forward."""
    plain: bool
    """Whether every linear layer is torch's own `Linear`, with nothing hooked: a pass on the model's own layers
    calls `F.linear` on their weights (a module call costs a few microseconds, two hundred of them a step)."""

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        """The parts of a Llama-shaped decoder layer (its attention's index is the one its cache updates use)."""
        attention, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = (attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)
        joins = not any(_hooked(module) for module in (*qkv, *gate_up))
        linears = (*qkv, attention.o_proj, *gate_up, mlp.down_proj)
        plain = all(type(module) is torch.nn.Linear and not _hooked(module) for module in linears)
        return cls(attention.layer_idx, layer.input_layernorm, attention, qkv, attention.o_proj,
                   layer.post_attention_layernorm, gate_up, mlp.down_proj, mlp.act_fn, joins, plain)  # fmt: skip

    def looped(self) -> LoopLayer:
        """What the compiled loop reads of this layer."""
        return LoopLayer(self.index, self.input_norm, self.attention, self.qkv, (self.o,), self.post_norm,
                         self.gate_up, (self.down,))  # fmt: skip


class DirectDecoder:
    """The model's forward pass (logits) as one loop over its layers; build with `of`."""

    def __init__(self, model: PreTrainedModel, modeling: ModuleType) -> None:
        self.config = model.config
        inner = model.model
        self._embed, self._rotary, self._norm, self._head = (
            inner.embed_tokens,
            inner.rotary_emb,
            inner.norm,
            model.lm_head,
        )
        self._eager: Callable = modeling.eager_attention_forward
        self._layers = [_Layer.of(layer) for layer in inner.layers[: self.config.num_hidden_layers]]
        self.loop = (
            LayerLoop.of([layer.looped() for layer in self._layers], self.config)
            if all(
                layer.joins and not _hooked(layer.o) and not _hooked(layer.down) and _silu(layer.act)
                for layer in self._layers
            )
            else None
        )
        """The layers in one compiled call where a pass allows it (layerloop.py); None: always the Python loop."""
        head = model.lm_head
        plain_head = type(head) is torch.nn.Linear and head.bias is None and not _hooked(head)
        self.argmax_head = ArgmaxHead.of(head.weight) if plain_head else None
        """Greedy passes' choices without the output layer's whole product (argmaxhead.py) where it pays; None:
        always from the whole product."""

    @classmethod
    def of(cls, model: PreTrainedModel) -> DirectDecoder | None:
        """A decoder for `model` if it is one of the Llama-shaped families, unmodified, without sliding windows or
        hooks on the modules the loop does not call; else None.

        The families are named (by the module that defines every class the loop replaces) rather than recognised by
        their parts: a family with Llama's parts can add math the check at start does not reach (Ministral3 scales
        queries from 16,384 positions on).
        """
        modeling = type(model).__module__
        if modeling not in _FAMILIES or not type(model).__name__.endswith("ForCausalLM"):
            return None
        inner = model.model
        replaced = [model, inner, inner.norm]
        for layer in inner.layers:
            replaced += [layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        if any(type(module).__module__ != modeling for module in replaced):
            return None  # a part swapped for another class: its math is not the family's
        if _slides(model.config) or any(_hooked(module) for module in replaced) or _global_hooks():
            return None
        if getattr(sys.modules[modeling].apply_rotary_pos_emb, "__module__", None) != modeling:
            return None  # the family's rotation replaced (a fused kernel patched in): the loop's own would not follow
        return cls(model, sys.modules[modeling])

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Cache,
        last_only: bool = False,
        linears: PackedLinears | None = None,
        most_rows: int | None = None,
        greedy: bool = False,
        **attention_kwargs,
    ) -> torch.Tensor:
        """Logits (rows, tokens, vocab) of the block, as `model(...)` computes them (with `greedy`, each position's
        first largest logit's index instead, int64 (rows, tokens)); `attention_kwargs` go on to the cache's update and
        the attention function, as the model passes its extra keywords. `linears` and `most_rows`: the packed layers
        the pass runs with (linears.packed_as): a layer's q/k/v projections, and its gate and up, run as one product
        each where they can (linears.PackedLinears.joined)."""
        hidden = self._embed(input_ids)
        implementation = self._layers[0].attention.config._attn_implementation
        mask = None
        if not _unmasked_step(input_ids, attention_mask, implementation, cache):
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **{_CACHE_KEYWORD: cache},
            )
        cos, signed_sin = _rotation(*self._rotary(hidden, position_ids=position_ids))
        loop = self.loop
        looped = loop(hidden, cos, signed_sin, mask, cache, linears, implementation, attention_kwargs) if loop else None
        if looped is not None:
            hidden = looped
        else:
            attention_kwargs = {"position_ids": position_ids, "use_cache": True, **attention_kwargs}  # as the model's
            hidden = self._layers_one_by_one(
                hidden, (cos, signed_sin), mask, cache, implementation, linears, most_rows, attention_kwargs
            )
        hidden = _rms_norm(self._norm, hidden)
        hidden = hidden[:, -1:] if last_only else hidden
        return self._choices(hidden, linears) if greedy else self._head(hidden)

    def _choices(self, hidden: torch.Tensor, linears: PackedLinears | None) -> torch.Tensor:
        """Each position's greedy choice: from the argmax head where the whole product would be the row kernel's (the
        bits it holds its candidates to), else the whole product's first largest logit."""
        weights, flat = None, hidden.reshape(-1, hidden.shape[-1])
        hooked = self._head._forward_hooks or self._head._forward_pre_hooks  # one added since the start: whole product
        if self.argmax_head is not None and linears is not None and rowkernel.fits(flat) and not hooked:
            weights = linears.row_weights((self._head,))
        if weights is not None:
            chosen = self.argmax_head.choices(flat, *weights)
            if chosen is not None:
                return chosen.view(hidden.shape[:-1])
        return first_largest(self._head(hidden))

    def _layers_one_by_one(
        self,
        hidden: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Cache,
        implementation: str,
        linears: PackedLinears | None,
        most_rows: int | None,
        attention_kwargs: dict,
    ) -> torch.Tensor:
        """The hidden states after the last layer, each layer's calls made from here (what the compiled loop does in
        one call where it can)."""
        cos, signed_sin = rotation
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, self._eager)
        shape = (*hidden.shape[:-1], -1)
        for layer in self._layers:
            direct = linears is None and layer.plain
            normed = _rms_norm(layer.input_norm, hidden)
            head_shape = (*shape[:-1], -1, layer.attention.head_dim)
            query, key, value = (
                part.view(head_shape).transpose(1, 2)
                for part in _products(linears if layer.joins else None, layer.qkv, normed, most_rows, direct)
            )
            query, key = _rotate(query, cos, signed_sin), _rotate(key, cos, signed_sin)
            key, value = cache.update(key, value, layer.index, kwargs=attention_kwargs)
            attended, _ = attend(
                layer.attention, query, key, value, mask, dropout=0.0, scaling=layer.attention.scaling,
                **attention_kwargs,
            )  # fmt: skip
            hidden = hidden + _product(layer.o, attended.reshape(shape).contiguous(), direct)
            normed = _rms_norm(layer.post_norm, hidden)
            gated, up = _products(linears if layer.joins else None, layer.gate_up, normed, most_rows, direct)
            hidden = hidden + _product(layer.down, layer.act(gated) * up, direct)
        return hidden


def _products(
    linears: PackedLinears | None,
    modules: tuple[torch.nn.Module, ...],
    x: torch.Tensor,
    most_rows: int | None,
    direct: bool,
) -> Sequence[torch.Tensor]:
    """Each module's output for `x`: one joined product where `linears` can make it, else one product each."""
    joined = linears.joined(modules, x, most_rows) if linears is not None else None
    return joined if joined is not None else [_product(module, x, direct) for module in modules]


def _product(module: torch.nn.Module, x: torch.Tensor, direct: bool) -> torch.Tensor:
    """`module(x)`; with `direct`, torch's `linear` on its weight (a plain Linear with nothing hooked)."""
    return F.linear(x, module.weight, module.bias) if direct else module(x)


def _rotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding's (rows, tokens, dim) cosine and sine as `_rotate` takes them: a heads axis added, the
    sine's first half negated."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotation of (rows, heads, tokens, dim) heads, `x * cos + rotate_half(x) * sin`, where rotate_half
    swaps the halves and negates the new first: swapping by one roll and negating the sine instead multiplies the
    same magnitudes with the same signs, so every bit is the same, with two operators fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _unmasked_step(ids: torch.Tensor, attention_mask: torch.Tensor | None, implementation: str, cache: Cache) -> bool:
    """Whether this pass is one token of one row with nothing padded, under attention that then takes no mask: its
    mask need not be built (transformers' mask preparation is a few hundred microseconds of a CPU step). A mask
    shorter than the keys (transformers pads it with hidden columns) or a compileable cache gets its mask built."""
    if ids.shape != (1, 1) or implementation not in _UNMASKED_STEPS or getattr(cache, "is_compileable", False):
        return False
    if attention_mask is None:
        return True
    return attention_mask.shape == (1, cache.get_seq_length() + 1) and bool(attention_mask.all())


def _slides(config: PretrainedConfig) -> bool:
    """Whether some layer attends over a sliding window (Qwen2 keeps a window size it uses only if told to)."""
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return True
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether calling the module does more than its class's forward (hooks, accelerate's, a replaced forward)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")) or (
        "forward" in vars(module)
    )


def _silu(module: Callable) -> bool:
    """Whether the MLP's activation is plain SiLU (torch's, or transformers' that calls it), nothing hooked or swapped
    in: what the compiled loop computes in its place."""
    return type(module) in (torch.nn.SiLU, SiLUActivation) and not _hooked(module)


def _global_hooks() -> bool:
    """Hooks registered for every module (torch.nn.modules.module.register_module_forward_hook)."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, rounded to the input's type, then scaled by the weight."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight, norm.variance_epsilon)
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)
