"""Tiny random-weight causal LMs of many families, built from configs (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

VOCAB = 512
_COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

FAMILIES: dict[str, dict] = {
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "mistral": {**_LLAMA_LIKE, "sliding_window": None},
    "gemma2": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 256},
    "gemma3_text": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 256},
    "phi3": {**_LLAMA_LIKE, "num_key_value_heads": 4},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
    "gpt_neox": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
    },
    "opt": {
        "hidden_size": 64,
        "ffn_dim": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "word_embed_proj_dim": 64,
    },
    "falcon": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "new_decoder_architecture": False},
    "bloom": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
}


def tiny_model(family: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A random 2-layer model of `family` in float32, eval mode, with peaked logits.

    A larger init range than the default makes the argmax clear of float noise and makes
    the model fall into repeating loops, which gives the trie something to draft from.
    """
    torch.manual_seed(seed)
    settings = {**_COMMON, **FAMILIES[family], "initializer_range": 0.2, **overrides}
    config = AutoConfig.for_model(family, **settings)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
