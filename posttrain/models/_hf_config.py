"""Hugging Face `config.json` <-> `ModelConfig`, for the architectures we support."""

from __future__ import annotations

import dataclasses
import json
import os

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models._config import MLAConfig, ModelConfig, MoEConfig, RopeScaling
from posttrain.models._hf_gemma import GEMMA_TYPES, gemma_from_hf, gemma_rope_view, gemma_to_hf
from posttrain.models._hf_vlm import (
    EXPORT_PREFIXES,
    VLM_ARCHITECTURES,
    VLM_TYPES,
    vlm_from_hf,
    vlm_to_hf,
    with_image_processor,
)

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", *GEMMA_TYPES, *VLM_TYPES,
)  # fmt: skip
_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Kimi K2 is DeepSeek-V3's architecture under its own name (its config.json says so).
_ALIASES = {"kimi_k2": "deepseek_v3"}


class HFFormatError(UserError, ValueError):
    """A model directory that cannot be loaded; the message says which file and what to change."""


def read_json(path: str) -> dict:
    try:
        return json.loads(paths.path(path).read_text())
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
    defaults = {f.name: f.default for f in dataclasses.fields(RopeScaling)}
    # Unknown keys are dropped; a null stands for the default, as in HF (whose yarn reads
    # `beta_fast or 32`), except `truncate`, which HF tests for truth: null means False.
    kwargs = {
        k: v
        for k, v in scaling.items()
        if k in defaults and k != "rope_type" and (v is not None or defaults[k] is None)
    }
    if "truncate" in scaling:
        kwargs["truncate"] = bool(scaling["truncate"])
    for k in ("beta_fast", "beta_slow"):
        if not kwargs.get(k, True):  # HF's `or`: 0 means the default too
            del kwargs[k]
    if rope_type in ("llama3", "yarn"):
        # As HF's `standardize_rope_params`: a top-level value wins (Phi-3 style files), then
        # the rope dict's, then max_position_embeddings.
        kwargs["original_max_position_embeddings"] = int(
            hf.get("original_max_position_embeddings")
            or kwargs.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 4096)
        )
    if rope_type == "yarn" and "factor" not in kwargs:
        # HF's yarn: no factor means the context grew from the original to max_position_embeddings.
        max_len = hf.get("max_position_embeddings", 4096)
        kwargs["factor"] = max_len / kwargs["original_max_position_embeddings"]
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


# The RopeScaling fields each rope type reads, in the order HF documents them.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "attention_factor",
    ),
}


def _rope_to_hf(scaling: RopeScaling) -> dict:
    """HF's `rope_scaling` dict: the type and the non-None fields that type reads."""
    values = {k: getattr(scaling, k) for k in _ROPE_KEYS[scaling.rope_type]}
    return {"rope_type": scaling.rope_type, **{k: v for k, v in values.items() if v is not None}}


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


def _moe_from_hf(hf: dict, model_type: str, source: str) -> tuple[MoEConfig | None, int]:
    """The MoE layer and how many leading layers stay dense; `(None, 0)` for a dense model."""
    if model_type == "qwen3_moe":
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if hf.get("decoder_sparse_step", 1) != 1:
            raise HFFormatError(
                f"{source}: decoder_sparse_step={hf['decoder_sparse_step']} (experts in every "
                f"n-th layer) is not supported; only 1, with mlp_only_layers a prefix [0, .., k-1]"
            )
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise HFFormatError(
                f"{source}: mlp_only_layers={dense} is not supported; only the first k layers "
                f"can be dense (mlp_only_layers = [0, 1, .., k-1])"
            )
        first_k_dense = len(dense)
        kwargs = dict(
            score_func="softmax",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        )
    elif model_type == "deepseek_v3":
        num_experts = hf.get("n_routed_experts", hf.get("num_local_experts"))
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise HFFormatError(f"{source}: scoring_func must be 'sigmoid' for deepseek_v3")
        first_k_dense = hf.get("first_k_dense_replace", 3) or 0  # defaults as in transformers
        kwargs = dict(
            score_func="sigmoid",
            num_shared_experts=hf.get("n_shared_experts", 1) or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            n_group=hf.get("n_group", 8) or 1,
            topk_group=hf.get("topk_group", 4) or 1,
            use_routing_bias=True,
        )
    else:
        return None, 0
    if not num_experts or first_k_dense >= hf["num_hidden_layers"]:
        return None, 0  # every layer dense
    try:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            expert_mlp_dim=hf["moe_intermediate_size"],
            **kwargs,
        )
    except ValueError as e:
        raise HFFormatError(f"{source}: {e}") from None
    return moe, first_k_dense


def _mla_from_hf(hf: dict, source: str) -> MLAConfig:
    if hf.get("attention_bias"):
        raise HFFormatError(
            f"{source}: attention_bias=true (biases on the MLA projections) is not supported "
            f"for deepseek_v3"
        )
    try:
        return MLAConfig(
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank", 1536),  # transformers' default
        )
    except ValueError as e:
        raise HFFormatError(f"{source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How an HF checkpoint stores what `ModelConfig` does not describe."""

    rope_interleave: bool = False  # MLA: each head's rope dims are stored as pairs (0,1),(2,3)..
    extra_layers: int = 0  # DeepSeek multi-token-prediction layers after the last; not loaded
    # VLMs: (our name prefix, the checkpoint's) per part (`_hf_vlm.checkpoint_prefixes`), and
    # the encoder's parts the model does not run (after the encoder's prefix; not loaded).
    prefixes: tuple[tuple[str, str], ...] = ()
    vision_unused: tuple[str, ...] = ()

    def skipped(self) -> tuple[str, ...]:
        """Checkpoint-name prefixes of tensors a load leaves out on purpose."""
        tower = dict(self.prefixes).get("vision_tower.", "vision_tower.")
        return tuple(tower + part for part in self.vision_unused)


def checkpoint_layout(hf: dict) -> CheckpointLayout:
    """The layout a `config.json` declares (transformers' defaults where it is silent); a
    VLM's `prefixes` come from its tensor names (`_hf_vlm.checkpoint_prefixes`)."""
    if hf.get("model_type") in VLM_TYPES:
        return CheckpointLayout(vision_unused=vlm_from_hf(hf)[3])
    if _ALIASES.get(hf.get("model_type"), hf.get("model_type")) != "deepseek_v3":
        return CheckpointLayout()
    extra = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1))
    return CheckpointLayout(
        rope_interleave=bool(hf.get("rope_interleave", True)), extra_layers=int(extra or 0)
    )


def export_layout(config: ModelConfig) -> CheckpointLayout:
    """The layout `to_hf` writes: DeepSeek's usual interleaved rope, no MTP layers, a VLM's
    parts named as transformers 5 saves them."""
    prefixes = EXPORT_PREFIXES if config.vision is not None else ()
    return CheckpointLayout(rope_interleave=config.mla is not None, prefixes=prefixes)


def _sparse_to_hf(config: ModelConfig, model_type: str) -> dict:
    """The MoE and MLA fields of `config_to_hf`; ValueError for what the HF type cannot say."""
    e, m = config.moe, config.mla
    if model_type == "qwen3_moe":
        unsupported = {
            "no qk_norm": not config.qk_norm,
            "qkv_bias without o_bias": config.qkv_bias != config.o_bias,
            "sliding windows on some layers only": config.sliding_window_layers is not None,
            "sigmoid router scores": e.score_func != "softmax",
            "shared experts": e.num_shared_experts > 0,
            "a routing bias": e.use_routing_bias,
            "group-limited routing": e.n_group > 1,
            "routed_scaling_factor != 1": e.routed_scaling_factor != 1.0,
        }
    else:
        unsupported = {
            "softmax router scores": e is not None and e.score_func != "sigmoid",
            "no routing bias": e is not None and not e.use_routing_bias,
            "no shared experts": e is not None and not e.num_shared_experts,
        }
    bad = [what for what, present in unsupported.items() if present]
    if bad:
        raise ValueError(
            f"model {config.name!r} cannot be written as HF {model_type} (the HF type for "
            f"{'MLA' if m else 'MoE without MLA'}): it has {', '.join(bad)}"
        )
    if model_type == "qwen3_moe":
        return {
            "num_experts": e.num_experts,
            "num_experts_per_tok": e.top_k,
            "moe_intermediate_size": e.expert_mlp_dim,
            "norm_topk_prob": e.norm_topk_prob,
            "router_aux_loss_coef": e.aux_loss_coef,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(config.first_k_dense)),
        }
    hf = {
        "num_key_value_heads": config.num_heads,
        "head_dim": m.qk_rope_head_dim,  # as transformers' DeepseekV3Config sets it
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_interleave": export_layout(config).rope_interleave,
        "num_nextn_predict_layers": 0,
        "first_k_dense_replace": config.first_k_dense if e else config.num_layers,
    }
    if e is not None:
        hf.update(
            n_routed_experts=e.num_experts,
            num_experts_per_tok=e.top_k,
            moe_intermediate_size=e.expert_mlp_dim,
            n_shared_experts=e.num_shared_experts,
            norm_topk_prob=e.norm_topk_prob,
            routed_scaling_factor=e.routed_scaling_factor,
            n_group=e.n_group,
            topk_group=e.topk_group,
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        )
    return hf


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
