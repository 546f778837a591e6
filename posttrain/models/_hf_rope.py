"""RoPE in HF configs: `rope_theta` and `rope_scaling`/`rope_parameters` <-> `RopeScaling`."""

from __future__ import annotations

import dataclasses

from posttrain.models._components import RopeScaling


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
