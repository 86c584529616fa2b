"""A Llama-shaped model's decoder stack run as one loop, without transformers' per-layer plumbing.

A one-token step of a small model on a CPU spends a fifth of its time around the arithmetic:
module calls that only pass keyword arguments on, and an RMSNorm written as eight operators.
This loop makes the same calls on the same modules and weights — the model's embedding,
rotary embedding and rotation, its linear layers (packed ones too: linears.packed_as swaps
their forwards), its cache's `update`, the attention function the pass is set to — and the
norms as torch's one RMSNorm operator. It is used only where a check at start finds it gives
the model's logits bit for bit (capability.check_direct_decoder), so it reaches the same
numbers by a shorter road, never other numbers.

Llama-shaped: every decoder layer holds exactly an input norm, attention of q/k/v/o
projections, a post-attention norm and a gated MLP, with full (not sliding) attention; Llama,
Qwen2, Mistral and SmolLM2 are. Anything else runs through the model's forward as before, and so
does a model whose forward was replaced on the instance.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

_LAYER_PARTS = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj"}
_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


class _Layer(NamedTuple):
    """One decoder layer's modules, looked up once."""

    index: int
    input_norm: torch.nn.Module
    attention: torch.nn.Module
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    post_norm: torch.nn.Module
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def of(cls, index: int, layer: torch.nn.Module) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        return cls(index, layer.input_layernorm, attention, *projections, layer.post_attention_layernorm,
                   mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn)  # fmt: skip


class DirectDecoder:
    """The model's forward pass (logits) as one loop over its layers; build with `of`."""

    def __init__(self, model: PreTrainedModel, rotate: Callable, eager: Callable) -> None:
        self.model = model
        self.config = model.config
        inner = model.model
        self._embed, self._rotary, self._norm, self._head = (
            inner.embed_tokens,
            inner.rotary_emb,
            inner.norm,
            model.lm_head,
        )
        self._rotate, self._eager = rotate, eager
        self._layers = [
            _Layer.of(index, layer) for index, layer in enumerate(inner.layers[: self.config.num_hidden_layers])
        ]

    @classmethod
    def of(cls, model: PreTrainedModel) -> DirectDecoder | None:
        """A decoder for `model` if it is Llama-shaped (see the module's docstring), else None."""
        inner = getattr(model, "model", None)
        if "forward" in vars(model) or (inner is not None and "forward" in vars(inner)):
            return None  # a forward replaced on the instance is the one to run
        if inner is None or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
            return None
        if not hasattr(model, "lm_head") or getattr(model.config, "final_logit_softcapping", None) is not None:
            return None
        if any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or []):
            return None
        for layer in inner.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attention is None or mlp is None or getattr(attention, "sliding_window", None) is not None:
                return None
            if not (_children(layer) == _LAYER_PARTS and _children(attention) == _ATTENTION_PARTS):
                return None
            if _children(mlp) - {"act_fn"} != _MLP_PARTS or not callable(getattr(mlp, "act_fn", None)):
                return None
            if not all(_is_rms_norm(norm) for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
                return None
        if not _is_rms_norm(inner.norm) or _slides(model.config):
            return None
        modeling = sys.modules[type(inner.layers[0].self_attn).__module__]
        rotate, eager = (
            getattr(modeling, "apply_rotary_pos_emb", None),
            getattr(modeling, "eager_attention_forward", None),
        )
        return cls(model, rotate, eager) if callable(rotate) and callable(eager) else None

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: Cache,
        last_only: bool = False,
        **attention_kwargs,
    ) -> torch.Tensor:
        """Logits (rows, tokens, vocab) of the block, as `model(...)` computes them; `attention_kwargs` go on to the
        cache's update and the attention function, as the model passes its extra keywords."""
        hidden = self._embed(input_ids)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{_CACHE_KEYWORD: cache},
        )
        cos, sin = self._rotary(hidden, position_ids=position_ids)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)
        shape = (*hidden.shape[:-1], -1)
        for layer in self._layers:
            normed = _rms_norm(layer.input_norm, hidden)
            head_shape = (*shape[:-1], -1, layer.attention.head_dim)
            query = layer.q(normed).view(head_shape).transpose(1, 2)
            key = layer.k(normed).view(head_shape).transpose(1, 2)
            value = layer.v(normed).view(head_shape).transpose(1, 2)
            query, key = self._rotate(query, key, cos, sin)
            key, value = cache.update(key, value, layer.index, kwargs=attention_kwargs)
            attended, _ = attend(
                layer.attention, query, key, value, mask, dropout=0.0, scaling=layer.attention.scaling,
                **attention_kwargs,
            )  # fmt: skip
            hidden = hidden + layer.o(attended.reshape(shape).contiguous())
            normed = _rms_norm(layer.post_norm, hidden)
            hidden = hidden + layer.down(layer.act(layer.gate(normed)) * layer.up(normed))
        hidden = _rms_norm(self._norm, hidden)
        return self._head(hidden[:, -1:] if last_only else hidden)


def _slides(config) -> bool:
    """Whether some layer attends over a sliding window (Qwen2 keeps a window size it does not use)."""
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def _children(module: torch.nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """Llama's RMSNorm: a weight, an epsilon, and no other parameters (Gemma's adds one to its weight: the check at
    start tells them apart)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and ([name for name, _ in module.named_parameters()] == ["weight"])
    )


def _rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, rounded to the input's type, then scaled by the weight."""
    if hidden.dtype == torch.float32:
        return F.rms_norm(hidden, (hidden.shape[-1],), norm.weight, norm.variance_epsilon)
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)
