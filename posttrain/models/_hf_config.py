"""Hugging Face `config.json` <-> `ModelConfig`, for the architectures we support."""

from __future__ import annotations

import os

from posttrain import paths
from posttrain.models._config import ModelConfig
from posttrain.models._hf_format import (
    _ALIASES,
    _ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    HFFormatError,
    read_json,
)
from posttrain.models._hf_gemma import GEMMA_TYPES, gemma_from_hf, gemma_rope_view, gemma_to_hf
from posttrain.models._hf_layout import CheckpointLayout, checkpoint_layout
from posttrain.models._hf_rope import _rope_from_hf, _rope_to_hf
from posttrain.models._hf_sparse import _mla_from_hf, _moe_from_hf, _sparse_to_hf
from posttrain.models._hf_vlm import (
    VLM_ARCHITECTURES,
    VLM_TYPES,
    vlm_from_hf,
    vlm_to_hf,
    with_image_processor,
)


def config_from_hf(hf: dict, *, source: str = "config.json", **overrides) -> ModelConfig:
    """Maps an HF `config.json` dict onto a `ModelConfig`; `overrides` replace fields after."""
    model_type = _ALIASES.get(hf.get("model_type"), hf.get("model_type"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(
            f"{source}: model_type {hf.get('model_type')!r} is not supported; supported "
            f"types are {', '.join(SUPPORTED_MODEL_TYPES + tuple(_ALIASES))}"
        )
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "quantized")
        raise HFFormatError(
            f"{source}: {method} quantized weights are not supported; dequantize the checkpoint "
            f"(e.g. to bfloat16) first"
        )
    if model_type in VLM_TYPES:  # the decoder's own config.json, then the image encoder
        try:
            text, vision, tie, _ = vlm_from_hf(hf)
        except (ValueError, TypeError) as e:
            raise HFFormatError(f"{source}: {e}") from None
        if text["model_type"] in VLM_TYPES:
            raise HFFormatError(f"{source}: text_config is a VLM ({text['model_type']})")
        config = config_from_hf(text, source=f"{source} (text_config)")
        return config.replace(vision=vision, tie_embeddings=tie, **overrides)
    gemma = model_type in GEMMA_TYPES
    if gemma:
        try:
            gemma_fields = gemma_from_hf(hf, model_type)
        except ValueError as e:
            raise HFFormatError(f"{source}: {e}") from None
        hf = gemma_rope_view(hf)  # the full-attention layers' rope, as other types write it
    elif hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise HFFormatError(f"{source}: mlp_bias=true is not supported")
    num_layers = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    moe, first_k_dense = _moe_from_hf(hf, model_type, source)
    mla = _mla_from_hf(hf, source) if model_type == "deepseek_v3" else None

    window, window_layers = hf.get("sliding_window"), None
    if gemma:
        window, window_layers = gemma_fields.pop("windows")
    elif model_type in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types")
        if layer_types:
            window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        elif hf.get("use_sliding_window"):
            window_layers = tuple(range(hf.get("max_window_layers", num_layers), num_layers))
        else:
            window_layers = ()
        if not window_layers:
            window, window_layers = None, None
    elif model_type == "qwen3_moe":  # one window for every layer, as Mistral
        window = window if hf.get("use_sliding_window") else None
    elif model_type in ("llama", "deepseek_v3"):
        window = None
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        # MLA expands keys and values to every head; DeepSeek's `head_dim` is its rope part.
        num_kv_heads=heads if mla else (hf.get("num_key_value_heads") or heads),
        head_dim=mla.qk_head_dim if mla else (hf.get("head_dim") or hf["hidden_size"] // heads),
        mlp_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=window,
        sliding_window_layers=window_layers,
        moe=moe,
        first_k_dense=first_k_dense,
        mla=mla,
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        name=hf.get("_name_or_path") or model_type,
        **(gemma_fields if gemma else {}),
    )
    return config.replace(**overrides) if overrides else config


def hf_model_type(config: ModelConfig) -> str:
    """The HF architecture that expresses `config` exactly."""
    if config.vision is not None:
        return "gemma3" if config.vision.projector == "gemma3" else "llava"
    if config.nnx is not None:
        raise ValueError(
            f"{config.nnx.builder} is your own Flax NNX module, which has no HF architecture; "
            "save its params from the run's checkpoint with your module's own code"
        )
    if config.mla is not None:
        return "deepseek_v3"
    if config.post_norms:
        return "gemma3_text" if config.qk_norm or config.rope_local_theta else "gemma2"
    if config.moe is not None:
        return "qwen3_moe"
    if config.qk_norm:
        return "qwen3"
    if config.qkv_bias and not config.o_bias:
        return "qwen2"
    if config.sliding_window is not None and config.sliding_window_layers is None:
        return "mistral"
    if config.sliding_window is not None:
        return "qwen2"
    return "llama"


def config_to_hf(config: ModelConfig, dtype: str) -> dict:
    if config.vision is not None:  # a VLM: its decoder's config inside the encoder's
        text = config_to_hf(config.replace(vision=None), dtype)
        hf = vlm_to_hf(config, text)
        return {"architectures": [VLM_ARCHITECTURES[hf["model_type"]]], **hf}
    model_type = hf_model_type(config)
    gemma_fields = {
        "norm_offset": config.norm_offset != 0,
        "embed_scale": config.embed_scale,
        "mlp_activation": config.mlp_activation != "silu",
        "attn_scale": config.attn_scale is not None,
        "attn_softcap": config.attn_softcap > 0,
        "final_softcap": config.final_softcap > 0,
        "rope_local_theta": config.rope_local_theta is not None,
    }
    if model_type not in GEMMA_TYPES and any(gemma_fields.values()):
        set_ = [name for name, present in gemma_fields.items() if present]
        raise ValueError(
            f"model {config.name!r} sets {', '.join(set_)} without post_norms: no HF "
            f"architecture has that layer (Gemma 2 has post_norms too)"
        )
    if model_type == "qwen2" and config.o_bias:
        raise ValueError("an output-projection bias with sliding windows has no HF equivalent")
    hf = {
        "model_type": model_type,
        "architectures": [_ARCHITECTURES[model_type]],
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.o_bias or (config.qkv_bias and model_type != "qwen2"),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if config.rope_scaling is not None:
        hf["rope_scaling"] = _rope_to_hf(config.rope_scaling)
    if model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    elif model_type in ("qwen2", "qwen3"):
        windows = config.layer_windows
        hf["use_sliding_window"] = config.sliding_window is not None
        hf["sliding_window"] = config.sliding_window
        hf["max_window_layers"] = config.num_layers
        hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
    elif model_type == "qwen3_moe":
        hf["use_sliding_window"] = config.sliding_window is not None
        hf["sliding_window"] = config.sliding_window
    elif model_type in GEMMA_TYPES:
        full_rope = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
        full_rope.update(hf.pop("rope_scaling", None) or {})
        del hf["hidden_act"]
        hf.update(gemma_to_hf(config, model_type, full_rope))
    if model_type in ("qwen3_moe", "deepseek_v3"):
        hf.update(_sparse_to_hf(config, model_type))
    return hf


def load_hf_config(path: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of an HF model directory; its name defaults to the directory name."""
    return load_hf_config_and_layout(path, **overrides)[0]


def load_hf_config_and_layout(path: str, **overrides) -> tuple[ModelConfig, CheckpointLayout]:
    """`load_hf_config`, plus how the directory's tensors are laid out."""
    path = os.fspath(path)
    if not paths.path(path).is_dir():  # read in place, local or gs:// (config.json is small)
        raise HFFormatError(f"model directory {path!r} does not exist")
    config_path = paths.join(path, "config.json")
    overrides.setdefault("name", os.path.basename(os.path.normpath(path)))
    hf = read_json(config_path)
    try:
        config, layout = config_from_hf(hf, source=config_path, **overrides), checkpoint_layout(hf)
    except KeyError as e:
        raise HFFormatError(f"{config_path} lacks the field {e.args[0]!r}") from None
    if config.vision is not None:  # the directory's image processor: resize filter, mean, std
        try:
            config = config.replace(vision=with_image_processor(config.vision, path))
        except ValueError as e:
            raise HFFormatError(str(e)) from None
    return config, layout
