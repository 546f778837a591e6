"""Model presets: the real sizes (shape-checked with `jax.eval_shape`, never allocated in tests)
and tiny ones for tests and the demo."""

from __future__ import annotations

from posttrain.models._config import ModelConfig, RopeScaling

_LLAMA31_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    "llama3_8b": ModelConfig(
        vocab_size=128_256,
        embed_dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14_336,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA31_ROPE,
        norm_eps=1e-5,
        compute_dtype="bfloat16",
        name="llama3_8b",
    ),
    "llama3_70b": ModelConfig(
        vocab_size=128_256,
        embed_dim=8192,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=28_672,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=_LLAMA31_ROPE,
        norm_eps=1e-5,
        compute_dtype="bfloat16",
        name="llama3_70b",
    ),
    "qwen3_8b": ModelConfig(
        vocab_size=151_936,
        embed_dim=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=12_288,
        max_seq_len=40_960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        compute_dtype="bfloat16",
        name="qwen3_8b",
    ),
    "qwen3_32b": ModelConfig(
        vocab_size=151_936,
        embed_dim=5120,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=25_600,
        max_seq_len=40_960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        compute_dtype="bfloat16",
        name="qwen3_32b",
    ),
    "mistral_7b": ModelConfig(
        vocab_size=32_768,
        embed_dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14_336,
        max_seq_len=32_768,
        rope_theta=1_000_000.0,
        norm_eps=1e-5,
        compute_dtype="bfloat16",
        name="mistral_7b",
    ),
    # Tiny models for tests, notebooks and the CPU demo.
    "tiny": ModelConfig(
        vocab_size=512,
        embed_dim=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=512,
        norm_eps=1e-6,
        name="tiny",
    ),
    # The demo's model: small enough to train from scratch on 2 CPU cores in minutes.
    "demo": ModelConfig(
        vocab_size=512,
        embed_dim=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=384,
        max_seq_len=512,
        norm_eps=1e-6,
        name="demo",
    ),
}

# Parameter counts published for the real presets (the shape checks compare against them).
PUBLISHED_PARAMS = {
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "qwen3_8b": 8.19e9,
    "qwen3_32b": 32.8e9,
    "mistral_7b": 7.25e9,
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
