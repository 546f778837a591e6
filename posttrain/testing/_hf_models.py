"""Tiny random transformers models of every supported architecture, saved to a directory."""

from __future__ import annotations

import numpy as np

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
)

# DeepSeek-V3 / Kimi K2 shapes: MLA (every head expands the shared latent, so kv heads = heads),
# 8 experts, top-2, one shared expert, the first layer dense.
_DEEPSEEK = dict(
    num_hidden_layers=3,
    num_key_value_heads=8,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
)

# Each entry is (HF config class name, kwargs); together they cover every feature of the model.
HF_ARCHS: dict[str, tuple[str, dict]] = {
    # Llama 3.1-style long-context RoPE, untied embeddings, GQA.
    "llama3": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    # Llama with tied embeddings and biases on every attention projection.
    "llama_tied_bias": (
        "LlamaConfig",
        dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=2),
    ),
    # Qwen2/2.5: q/k/v bias, tied embeddings as in the small Qwen2.5 models.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # Qwen2 with sliding windows on some layers only (per-layer window switch).
    "qwen2_mixed_window": (
        "Qwen2Config",
        dict(
            use_sliding_window=True,
            sliding_window=3,
            max_window_layers=1,
            num_hidden_layers=3,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        ),
    ),
    # Qwen3: q/k RMSNorm, explicit head_dim different from hidden/heads.
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False)),
    # Mistral: sliding window shorter than the test sequences.
    "mistral": ("MistralConfig", dict(sliding_window=4, head_dim=8)),
    # Qwen3-MoE: softmax top-2 of 8 experts, renormalised; layer 0 dense (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    # Gemma 2: (1 + w) norms around attention and MLP, GeGLU, sqrt(D)-scaled embeddings, a
    # query scale of its own, sliding windows on every other layer, soft-capped attention and
    # final logits; weights large enough (initializer_range) that the caps bend the scores.
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=4,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            initializer_range=0.2,
        ),
    ),
    # Gemma 3 (text): Gemma 2's layer with q/k norms instead of soft-caps; sliding layers rotate
    # by plain RoPE of their own base, full layers by a linearly scaled one (as the 27B does).
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=4,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            initializer_range=0.2,
        ),
    ),
    # DeepSeek-V3: query latent, interleaved rope, sigmoid routing limited to 1 of 2 expert
    # groups with a selection bias, scaled.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(_DEEPSEEK, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    ),
    # Kimi K2-like routing (one group, scale 2.827) with a direct query projection and rope
    # stored in halves.
    "deepseek_v3_no_q_lora": (
        "DeepseekV3Config",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            rope_interleave=False,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
        ),
    ),
}


def save_tiny_hf_model(arch: str, path: str, *, seed: int = 0, **overrides) -> str:
    """Builds a random transformers model of `arch` (see HF_ARCHS) and saves it to `path`."""
    import torch
    import transformers

    class_name, kwargs = HF_ARCHS[arch]
    config = getattr(transformers, class_name)(**{**_COMMON, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms start at 1 and biases at 0; randomise so the tests see them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # MoE routers start at zero in some versions
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # DeepSeek's routing bias is a buffer, saved too
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def hf_logits(
    path: str, tokens: np.ndarray, attention_mask: np.ndarray | None = None
) -> np.ndarray:
    """float32 logits of the HF model saved at `path` (eager attention), as numpy."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    mask = None if attention_mask is None else torch.tensor(attention_mask)
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), attention_mask=mask)
    return out.logits.float().numpy()


_VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    layer_norm_eps=1e-6,
)
IMAGE_TOKEN = 250  # the tiny VLMs' image placeholder (inside their 256-token vocabulary)

# Tiny VLMs: (HF config class name, kwargs with `text_config`/`vision_config` dicts).
HF_VLMS: dict[str, tuple[str, dict]] = {
    # Gemma 3 image-text: the tiny Gemma 3 decoder under a 2-layer SigLIP whose 4 x 4 patches
    # pool to 2 x 2 image tokens; image tokens see each other both ways.
    "gemma3": (
        "Gemma3Config",
        dict(
            text_config=dict(_COMMON, **HF_ARCHS["gemma3_text"][1], model_type="gemma3_text"),
            vision_config=dict(_VISION, vision_use_head=False),
            mm_tokens_per_image=4,
            image_token_id=IMAGE_TOKEN,
            boi_token_id=251,
            eoi_token_id=252,
        ),
    ),
    # LLaVA: a Llama decoder reading the next-to-last of 3 SigLIP layers through a GELU MLP,
    # one token per patch; the encoder's pooling head and last layer stay unused.
    "llava": (
        "LlavaConfig",
        dict(
            text_config=dict(_COMMON, model_type="llama"),
            vision_config=dict(_VISION, num_hidden_layers=3, model_type="siglip_vision_model"),
            image_token_id=IMAGE_TOKEN,
            image_seq_length=16,
            vision_feature_layer=-2,
            vision_feature_select_strategy="full",
        ),
    ),
}


def save_tiny_hf_vlm(arch: str, path: str, *, seed: int = 0) -> str:
    """Builds a random transformers VLM of `arch` (see HF_VLMS) and saves it to `path`."""
    import torch
    import transformers

    class_name, kwargs = HF_VLMS[arch]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(
        config, attn_implementation="eager"
    )
    with torch.no_grad():  # norms start at 1 (or 0), biases and Gemma's projection at 0
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", ".bias")):
                p.add_(0.1 * torch.randn_like(p))
            elif "mm_input_projection" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def hf_vlm_logits(
    path: str, tokens: np.ndarray, mask: np.ndarray, pixels: np.ndarray | None
) -> np.ndarray:
    """float32 logits of the HF VLM at `path` (eager attention); `pixels` `[images, H, W, C]`
    in the rows' order (None: text only). Gemma 3 gets its image tokens' `token_type_ids`."""
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = torch.tensor(tokens, dtype=torch.long)
    kwargs = dict(input_ids=ids, attention_mask=torch.tensor(mask))
    if pixels is not None:
        kwargs["pixel_values"] = torch.tensor(pixels).permute(0, 3, 1, 2).float()
    if model.config.model_type == "gemma3":
        kwargs["token_type_ids"] = (ids == model.config.image_token_id).long()
    with torch.no_grad():
        return model(**kwargs).logits.float().numpy()
