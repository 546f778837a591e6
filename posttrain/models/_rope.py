"""Rotary position embeddings (HF's rotate-half layout) with linear, llama3 and yarn scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models._config import ModelConfig


def _rope_dim(config: ModelConfig) -> int:
    # MLA models rotate only part of each head; `rope_dim` is that part where it exists.
    return getattr(config, "rope_dim", config.head_dim)


def _powers(theta: float, dim: int) -> np.ndarray:
    """theta ** (2i / dim) in float32, as HF's `base ** (arange(0, dim, 2) / dim)`."""
    # Rounded from float64, which torch's float32 pow nearly always equals; numpy's float32 pow
    # is an ulp off for a fifth of them, enough to move cos/sin by up to 1e-3 at position 1e4.
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    return (float(theta) ** exponents.astype(np.float64)).astype(np.float32)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """HF `_compute_yarn_parameters`' frequencies, op for op in float32."""
    scaling, dim, base = config.rope_scaling, _rope_dim(config), config.rope_theta
    old_len = scaling.original_max_position_embeddings

    def correction_dim(rotations):  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 where the frequency is kept (extrapolated), 0 where divided by factor
    pos_freqs = _powers(base, dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """The rope_dim/2 rotation frequencies, scaled as `config.rope_scaling` asks; float32 as HF."""
    dim = _rope_dim(config)
    inv_freq = (1.0 / _powers(config.rope_theta, dim)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(config)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """HF's `attention_factor`: what cos and sin are multiplied by (1.0 except for yarn)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:  # HF tests truthiness: 0 means unset
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return _yarn_mscale(scaling.factor)


def rope_angles(positions_BL: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every position's angles, `[B, L, rope_dim/2]` float32.

    Both are multiplied by `rope_attention_factor(config)`, as HF's rotary embedding does, so
    yarn's attention temperature reaches q.k through the rotation of both.

    With `config.rope_local_theta` (Gemma 3), the sliding-window layers' plain-RoPE angles
    follow on the last axis, `[B, L, rope_dim]`: `layer_rope` picks a layer's half.
    """
    inv_freq = jnp.asarray(inverse_frequencies(config))
    angles = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    factor = rope_attention_factor(config)
    cos, sin = jnp.cos(angles) * factor, jnp.sin(angles) * factor
    if config.rope_local_theta is None:
        return cos, sin
    local = config.replace(rope_theta=config.rope_local_theta, rope_scaling=None)
    local = local.replace(rope_local_theta=None)
    cos_local, sin_local = rope_angles(positions_BL, local)
    return jnp.concatenate([cos, cos_local], -1), jnp.concatenate([sin, sin_local], -1)


def layer_rope(cos, sin, config: ModelConfig, sliding) -> tuple[jax.Array, jax.Array]:
    """A layer's cos and sin from `rope_angles`: with `rope_local_theta`, the local half when
    `sliding` (a traced bool: is this layer's window > 0), else the full layers' half."""
    if config.rope_local_theta is None:
        return cos, sin
    h = cos.shape[-1] // 2
    return (
        jnp.where(sliding, cos[..., h:], cos[..., :h]),
        jnp.where(sliding, sin[..., h:], sin[..., :h]),
    )


def apply_rope(x_BLNH: jax.Array, cos_BLh: jax.Array, sin_BLh: jax.Array) -> jax.Array:
    """Rotates the two halves of the head dimension (HF `rotate_half` layout, not interleaved)."""
    x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_BLh[:, :, None, :], sin_BLh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLNH.dtype)
