"""The peer implementations benchmarks compare against, built from our ModelConfig."""

from __future__ import annotations

from posttrain.models import ModelConfig


def hf_llama(config: ModelConfig, dtype: str = "float32", device: str = "cpu"):
    """transformers' LlamaForCausalLM with the same shapes as `config` (SDPA attention)."""
    import torch
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.embed_dim,
        intermediate_size=config.mlp_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
    )
    model = transformers.LlamaForCausalLM._from_config(
        hf_config, attn_implementation="sdpa", dtype=getattr(torch, dtype)
    )
    return model.to(device)
