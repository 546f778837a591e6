"""Mixture-of-experts and MLA fields of HF configs, both ways (Qwen3-MoE, DeepSeek-V3)."""

from __future__ import annotations

from posttrain.models._components import MLAConfig, MoEConfig
from posttrain.models._config import ModelConfig
from posttrain.models._hf_format import HFFormatError
from posttrain.models._hf_layout import export_layout


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
