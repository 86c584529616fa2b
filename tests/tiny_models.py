"""Tiny random-weight causal LMs of many families, built from configs (nothing downloaded), and one as a GGUF file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lookahead.models import _assemble_bundled

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


def named_tiny_llama(name: str) -> PreTrainedModel:
    """A tiny Llama under `name`: what the engine measures for a named model is cached (a model without a name is
    measured every time)."""
    model = tiny_model("llama")
    model.config._name_or_path = name
    return model


def tiny_gguf(path: Path, vocab: int = VOCAB) -> Path:
    """A random 2-layer Llama as a GGUF file, with the bundled model's tokenizer cut to its first `vocab` tokens.

    Converting the bundled model takes about 25 s here, most of it spent reading its 49,152 tokens and
    48,900 merges; this one converts in a moment, through the same code.
    """
    source = gguf.GGUFReader(_assemble_bundled("smollm2-135m"))
    tokens = source.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    kept = set(tokens)
    merges = [
        m for m in source.fields["tokenizer.ggml.merges"].contents() if {*m.split(" "), m.replace(" ", "")} <= kept
    ]
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if key.startswith("tokenizer.") and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            value = field.contents()
            writer.add_key_value(key, value[:vocab] if isinstance(value, list) else value, *field.types[:2])
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    shape = _LLAMA_LIKE
    width, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(width)
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(width // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)

    def weights(*dims: int) -> np.ndarray:
        return rng.normal(0, 0.02, dims).astype(np.float32)

    kv = kv_heads * width // heads
    writer.add_tensor("token_embd.weight", weights(vocab, width))
    writer.add_tensor("output_norm.weight", np.ones(width, np.float32))
    for block in range(shape["num_hidden_layers"]):
        for name, dims in [("attn_q", (width, width)), ("attn_k", (kv, width)), ("attn_v", (kv, width)),
                           ("attn_output", (width, width)), ("ffn_gate", (shape["intermediate_size"], width)),
                           ("ffn_up", (shape["intermediate_size"], width)),
                           ("ffn_down", (width, shape["intermediate_size"]))]:  # fmt: skip
            writer.add_tensor(f"blk.{block}.{name}.weight", weights(*dims))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{block}.{name}.weight", np.ones(width, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
