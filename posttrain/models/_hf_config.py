"""Hugging Face `config.json` <-> `ModelConfig`, for the architectures we support."""

from __future__ import annotations

import dataclasses
import json
import os

from posttrain.models._config import ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class HFFormatError(ValueError):
    """A model directory that cannot be loaded; the message says which file and what to change."""


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HFFormatError(f"{path} is missing; a Hugging Face model directory needs it") from None
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds theta and scaling into `rope_parameters`; older files use two keys.
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    kwargs = {k: v for k, v in scaling.items() if k in fields and k != "rope_type"}
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def config_from_hf(hf: dict, *, source: str = "config.json", **overrides) -> ModelConfig:
    """Maps an HF `config.json` dict onto a `ModelConfig`; `overrides` replace fields after."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFormatError(
            f"{source}: model_type {model_type!r} is not supported; supported "
            f"types are {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise HFFormatError(f"{source}: mlp_bias=true is not supported")
    num_layers = hf["num_hidden_layers"]
    heads = hf["num_attention_heads"]
    theta, scaling = _rope_from_hf(hf)
    attention_bias = bool(hf.get("attention_bias", False))

    window, window_layers = hf.get("sliding_window"), None
    if model_type in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types")
        if layer_types:
            window_layers = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        elif hf.get("use_sliding_window"):
            window_layers = tuple(range(hf.get("max_window_layers", num_layers), num_layers))
        else:
            window_layers = ()
        if not window_layers:
            window, window_layers = None, None
    elif model_type == "llama":
        window = None
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        sliding_window_layers=window_layers,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        name=hf.get("_name_or_path") or model_type,
    )
    return config.replace(**overrides) if overrides else config


def hf_model_type(config: ModelConfig) -> str:
    """The HF architecture that expresses `config` exactly."""
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
    model_type = hf_model_type(config)
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
        hf["rope_scaling"] = dataclasses.asdict(config.rope_scaling)
    if model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    elif model_type in ("qwen2", "qwen3"):
        windows = config.layer_windows
        hf["use_sliding_window"] = config.sliding_window is not None
        hf["sliding_window"] = config.sliding_window
        hf["max_window_layers"] = config.num_layers
        hf["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
    return hf


def load_hf_config(path: str, **overrides) -> ModelConfig:
    """The `ModelConfig` of an HF model directory; its name defaults to the directory name."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise HFFormatError(f"model directory {path!r} does not exist")
    config_path = os.path.join(path, "config.json")
    overrides.setdefault("name", os.path.basename(os.path.normpath(path)))
    try:
        return config_from_hf(read_json(config_path), source=config_path, **overrides)
    except KeyError as e:
        raise HFFormatError(f"{config_path} lacks the field {e.args[0]!r}") from None
