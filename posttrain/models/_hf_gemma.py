"""Gemma 2 and Gemma 3 (text) `config.json` <-> the `ModelConfig` fields of their layer.

Both put a (1 + w) RMSNorm before and after attention and the MLP, a GeGLU with tanh GELU,
sqrt(D)-scaled embeddings tied to the output, their own query scale and sliding windows on
some layers. Gemma 2 soft-caps attention and final logits; Gemma 3 norms q and k instead, and
its sliding layers rotate by plain RoPE of their own base (`rope_local_theta`).
"""

from __future__ import annotations

from posttrain.models._config import ModelConfig

GEMMA_TYPES = ("gemma2", "gemma3_text")
# transformers' defaults: caps and the pattern of sliding layers (every n-th is full).
_DEFAULTS = {
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "pattern": 2},
    "gemma3_text": {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "pattern": 6},
}  # fmt: skip
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _layer_rope(hf: dict, layer_type: str) -> dict:
    """Gemma 3's rope dict of one layer type, from `rope_parameters` keyed by layer type
    (transformers 5) or the older `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    if layer_type in params:
        return dict(params[layer_type])
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    scaling = dict(hf.get("rope_scaling") or {})
    return {"rope_type": "default", **scaling, "rope_theta": hf.get("rope_theta", 1e6)}


def gemma_rope_view(hf: dict) -> dict:
    """`hf` with the full-attention layers' rope as a plain `rope_parameters` (what the other
    types' reader takes); Gemma 2's is already plain."""
    if hf.get("model_type") != "gemma3_text":
        return hf
    return {**hf, "rope_parameters": _layer_rope(hf, "full_attention"), "rope_scaling": None}


def gemma_from_hf(hf: dict, model_type: str) -> dict:
    """The Gemma fields of `ModelConfig`, plus `"windows": (sliding_window, sliding layers)`;
    ValueError for what the decoder cannot run."""
    defaults = _DEFAULTS[model_type]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an encoder) is not supported")
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", defaults["pattern"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    window = hf.get("sliding_window")
    cap_keys = ("attn_logit_softcapping", "final_logit_softcapping")
    caps = {k: hf.get(k, defaults[k]) for k in cap_keys}
    fields = dict(
        norm_offset=1.0,
        post_norms=True,
        embed_scale=True,
        mlp_activation="gelu_tanh",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=float(caps["attn_logit_softcapping"] or 0.0),
        final_softcap=float(caps["final_logit_softcapping"] or 0.0),
        windows=(window, sliding) if window and sliding else (None, None),
    )
    if model_type == "gemma3_text":
        local = _layer_rope(hf, "sliding_attention")
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"sliding layers with {local['rope_type']!r} rope are not supported (default)"
            )
        fields.update(rope_local_theta=float(local.get("rope_theta", 10_000.0)))
    return fields


def gemma_to_hf(config: ModelConfig, model_type: str, full_rope: dict) -> dict:
    """The `config.json` fields of `model_type` that `config_to_hf`'s common ones lack, given
    the full-attention layers' rope dict (`rope_type`, `rope_theta` and scaling fields);
    ValueError for a config the HF type cannot say."""
    gemma3 = model_type == "gemma3_text"
    unsupported = {
        "norm_offset != 1": config.norm_offset != 1,
        "no embed_scale": not config.embed_scale,
        "a SwiGLU (mlp_activation silu)": config.mlp_activation != "gelu_tanh",
        "qkv or output biases": config.qkv_bias or config.o_bias,
        "experts": config.moe is not None,
        "sliding windows on every layer": (
            config.sliding_window is not None and config.sliding_window_layers is None
        ),
        "no qk_norm" if gemma3 else "qk_norm": config.qk_norm != gemma3,
        "no rope_local_theta": gemma3 and config.rope_local_theta is None,
    }
    bad = [what for what, present in unsupported.items() if present]
    if bad:
        raise ValueError(
            f"model {config.name!r} cannot be written as HF {model_type}: it has {', '.join(bad)}"
        )
    scalar = config.scale**-2
    hf = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        "attn_logit_softcapping": config.attn_softcap or None,
        "final_logit_softcapping": config.final_softcap or None,
        "sliding_window": config.sliding_window,
        "layer_types": [
            "sliding_attention" if w else "full_attention" for w in config.layer_windows
        ],
        "rope_parameters": full_rope,
    }
    if gemma3:
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta}
        hf["rope_parameters"] = {"full_attention": full_rope, "sliding_attention": local}
    return hf
