"""Model presets: the real sizes (shape-checked with `jax.eval_shape`, never allocated in tests)
and tiny ones for tests and the demo."""

from __future__ import annotations

from posttrain.models._components import MLAConfig, MoEConfig, RopeScaling, VisionConfig
from posttrain.models._config import ModelConfig

_LLAMA31_ROPE = RopeScaling(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)

PRESETS: dict[str, ModelConfig] = {
    "llama3_1b": ModelConfig(  # Llama 3.2 1B
        vocab_size=128_256,
        embed_dim=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        max_seq_len=131_072,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        norm_eps=1e-5,
        tie_embeddings=True,
        compute_dtype="bfloat16",
        name="llama3_1b",
    ),
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
    # Sparse MoE. DeepSeek-V3 and Kimi K2: MLA, sigmoid routing with a selection bias, one
    # shared expert, dense first layer(s), YaRN RoPE. Qwen3-235B-A22B: GQA, softmax top-8.
    "deepseek_v3_671b": ModelConfig(
        vocab_size=129_280,
        embed_dim=7168,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        mlp_dim=18_432,
        max_seq_len=163_840,
        rope_theta=10_000.0,
        rope_scaling=RopeScaling(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        norm_eps=1e-6,
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=1536,
        ),
        moe=MoEConfig(
            num_experts=256,
            top_k=8,
            expert_mlp_dim=2048,
            num_shared_experts=1,
            score_func="sigmoid",
            routed_scaling_factor=2.5,
            n_group=8,
            topk_group=4,
            use_routing_bias=True,
        ),
        first_k_dense=3,
        compute_dtype="bfloat16",
        name="deepseek_v3_671b",
    ),
    "kimi_k2_1t": ModelConfig(
        vocab_size=163_840,
        embed_dim=7168,
        num_layers=61,
        num_heads=64,
        num_kv_heads=64,
        head_dim=192,
        mlp_dim=18_432,
        max_seq_len=131_072,
        rope_theta=50_000.0,
        rope_scaling=RopeScaling(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        norm_eps=1e-6,
        mla=MLAConfig(
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=1536,
        ),
        moe=MoEConfig(
            num_experts=384,
            top_k=8,
            expert_mlp_dim=2048,
            num_shared_experts=1,
            score_func="sigmoid",
            routed_scaling_factor=2.827,
            use_routing_bias=True,
        ),
        first_k_dense=1,
        compute_dtype="bfloat16",
        name="kimi_k2_1t",
    ),
    "qwen3_235b_a22b": ModelConfig(
        vocab_size=151_936,
        embed_dim=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        mlp_dim=12_288,
        max_seq_len=40_960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        qk_norm=True,
        moe=MoEConfig(num_experts=128, top_k=8, expert_mlp_dim=1536),
        compute_dtype="bfloat16",
        name="qwen3_235b_a22b",
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
    # A tiny LLaVA-style VLM for the shapes task (posttrain.demo._shapes: 32-word vocabulary,
    # "<image>" is id 3): 32 x 32 images in 8 x 8 patches, one token per patch.
    "tiny_vlm": ModelConfig(
        vocab_size=32,
        embed_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=256,
        norm_eps=1e-6,
        vision=VisionConfig(
            image_size=32,
            patch_size=8,
            width=32,
            mlp_dim=64,
            num_layers=1,
            num_heads=2,
            tokens_per_image=16,
            image_token_id=3,
            projector="mlp",
            final_norm=False,
        ),  # fmt: skip
        name="tiny_vlm",
    ),
    # Tiny MoE models: Qwen3-MoE-like, and DeepSeek-V3-like (MLA, groups, shared expert,
    # one dense layer, routing bias).
    "tiny_moe": ModelConfig(
        vocab_size=512,
        embed_dim=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=16,
        mlp_dim=128,
        max_seq_len=512,
        qk_norm=True,
        moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=32),
        name="tiny_moe",
    ),
    "tiny_mla_moe": ModelConfig(
        vocab_size=512,
        embed_dim=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=24,
        mlp_dim=128,
        max_seq_len=512,
        mla=MLAConfig(
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32
        ),
        moe=MoEConfig(
            num_experts=8,
            top_k=2,
            expert_mlp_dim=32,
            num_shared_experts=1,
            score_func="sigmoid",
            routed_scaling_factor=2.5,
            n_group=2,
            topk_group=1,
            use_routing_bias=True,
        ),
        first_k_dense=1,
        name="tiny_mla_moe",
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

# The tiny model at long lengths (long-context tests and the memory benchmark): a 32k
# vocabulary, positions up to 128k, blocked attention and chunked logits.
PRESETS["tiny_long"] = PRESETS["tiny"].replace(
    vocab_size=32_768,
    max_seq_len=131_072,
    rope_theta=1_000_000.0,
    attention="flash",
    logits_chunk=1024,
    name="tiny_long",
)

# Qwen3 8B with YaRN stretched to 1M positions (32 x its 32k pre-training context, as Qwen's
# own YaRN recipe stretches it 4x to 128k): the 1M-token long-context plan's model.
PRESETS["qwen3_8b_1m"] = PRESETS["qwen3_8b"].replace(
    max_seq_len=1_048_576,
    rope_scaling=RopeScaling(
        rope_type="yarn", factor=32.0, original_max_position_embeddings=32_768
    ),
    name="qwen3_8b_1m",
)


def _gemma(name: str, **fields) -> ModelConfig:
    """A Gemma 2 or Gemma 3 (text) size: what every size shares, plus `fields`."""
    shared = dict(
        norm_eps=1e-6,
        norm_offset=1.0,  # (1 + w) norms
        post_norms=True,
        embed_scale=True,
        mlp_activation="gelu_tanh",
        tie_embeddings=True,
        compute_dtype="bfloat16",
        name=name,
    )
    return ModelConfig(**shared, **fields)


def _gemma2(name: str, *, num_layers: int, query_scalar: int, **shape) -> ModelConfig:
    """Gemma 2: soft-capped attention (50) and logits (30); layers 0, 2, 4, ... slide over
    4096 keys, the others attend to the whole 8k context."""
    return _gemma(
        name,
        vocab_size=256_000,
        num_layers=num_layers,
        max_seq_len=8192,
        rope_theta=10_000.0,
        attn_scale=query_scalar**-0.5,  # query_pre_attn_scalar
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=4096,
        sliding_window_layers=tuple(range(0, num_layers, 2)),
        **shape,
    )


def _gemma3(name: str, *, num_layers: int, query_scalar: int, **fields) -> ModelConfig:
    """Gemma 3 (text): q/k norms, five sliding layers (plain RoPE, base 10k) then one full
    layer (base 1M), layer i full iff (i + 1) % 6 == 0."""
    return _gemma(
        name,
        num_layers=num_layers,
        rope_theta=1_000_000.0,
        rope_local_theta=10_000.0,
        qk_norm=True,
        attn_scale=query_scalar**-0.5,  # query_pre_attn_scalar
        sliding_window_layers=tuple(i for i in range(num_layers) if (i + 1) % 6),
        **fields,
    )


# Gemma 3 4B/12B/27B: 128k positions by linear RoPE interpolation (x8) on the full layers; their
# config.json's vocabulary is 262208 (the 1B's is 262144; the image token is 262144).
_GEMMA3_128K = dict(
    vocab_size=262_208, max_seq_len=131_072, sliding_window=1024,
    rope_scaling=RopeScaling(rope_type="linear", factor=8.0),
)  # fmt: skip

# Shapes from each model's HF config.json (Gemma 3 4B+: its text_config).
PRESETS.update(
    gemma2_2b=_gemma2(
        "gemma2_2b", embed_dim=2304, num_layers=26, num_heads=8, num_kv_heads=4,
        head_dim=256, mlp_dim=9216, query_scalar=256,
    ),
    gemma2_9b=_gemma2(
        "gemma2_9b", embed_dim=3584, num_layers=42, num_heads=16, num_kv_heads=8,
        head_dim=256, mlp_dim=14_336, query_scalar=256,
    ),
    gemma2_27b=_gemma2(  # queries scaled by (D / N)**-0.5 = 144**-0.5, not head_dim**-0.5
        "gemma2_27b", embed_dim=4608, num_layers=46, num_heads=32, num_kv_heads=16,
        head_dim=128, mlp_dim=36_864, query_scalar=144,
    ),
    gemma3_1b=_gemma3(
        "gemma3_1b", vocab_size=262_144, embed_dim=1152, num_layers=26, num_heads=4,
        num_kv_heads=1, head_dim=256, mlp_dim=6912, query_scalar=256, max_seq_len=32_768,
        sliding_window=512,
    ),
    gemma3_4b=_gemma3(
        "gemma3_4b", embed_dim=2560, num_layers=34, num_heads=8, num_kv_heads=4,
        head_dim=256, mlp_dim=10_240, query_scalar=256, **_GEMMA3_128K,
    ),
    gemma3_12b=_gemma3(
        "gemma3_12b", embed_dim=3840, num_layers=48, num_heads=16, num_kv_heads=8,
        head_dim=256, mlp_dim=15_360, query_scalar=256, **_GEMMA3_128K,
    ),
    gemma3_27b=_gemma3(  # queries scaled by (D / N)**-0.5 = 168**-0.5
        "gemma3_27b", embed_dim=5376, num_layers=62, num_heads=32, num_kv_heads=16,
        head_dim=128, mlp_dim=21_504, query_scalar=168, **_GEMMA3_128K,
    ),
)  # fmt: skip


# Gemma 3's image-text models: the text decoder under a 400M SigLIP (So400m/14 at 896 px: 4096
# patches pooled to 256 image tokens), from Gemma3ForConditionalGeneration's config.json.
_GEMMA3_SIGLIP = VisionConfig(
    image_size=896, patch_size=14, width=1152, mlp_dim=4304, num_layers=27, num_heads=16,
    tokens_per_image=256, image_token_id=262_144, projector="gemma3", bidirectional=True,
)  # fmt: skip
for _size in ("4b", "12b", "27b"):
    PRESETS[f"gemma3_{_size}_vlm"] = PRESETS[f"gemma3_{_size}"].replace(
        vision=_GEMMA3_SIGLIP, name=f"gemma3_{_size}_vlm"
    )

# Parameter counts published for the real presets (the shape checks compare against them).
PUBLISHED_PARAMS = {
    "llama3_1b": 1.24e9,
    "llama3_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "qwen3_8b": 8.19e9,
    "qwen3_32b": 32.8e9,
    "mistral_7b": 7.25e9,
    "deepseek_v3_671b": 671e9,  # without the multi-token-prediction layer
    "kimi_k2_1t": 1.03e12,  # the model card says "1T"; its config.json shapes give 1.026T
    "qwen3_235b_a22b": 235e9,
    # Gemma 2: the technical report's non-embedding counts (2.02B, 8.32B, 26.05B) plus the HF
    # checkpoints' 256000 x D embedding.
    "gemma2_2b": 2.61e9,
    "gemma2_9b": 9.24e9,
    "gemma2_27b": 27.2e9,
    "gemma3_1b": 1.00e9,
    # Gemma 3 4B/12B/27B are published with their vision encoder (4.3B, 12.2B, 27.4B on the
    # model cards): these are the text decoders alone. Plus the 400M SigLIP tower and its
    # projector (0.42B), transformers' Gemma3ForConditionalGeneration has 4.30B, 12.19B, 27.43B.
    "gemma3_4b": 3.88e9,
    "gemma3_12b": 11.77e9,
    "gemma3_27b": 27.01e9,
    "gemma3_4b_vlm": 4.30e9,
    "gemma3_12b_vlm": 12.19e9,
    "gemma3_27b_vlm": 27.43e9,
}

# Parameters a token passes through (published "activated" counts) for the MoE presets.
PUBLISHED_ACTIVE_PARAMS = {
    "deepseek_v3_671b": 37e9,
    "kimi_k2_1t": 32e9,
    "qwen3_235b_a22b": 22e9,
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced by `overrides`."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
