"""Rotary position embeddings (HF's rotate-half convention) with linear and llama3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models._config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """The H/2 rotation frequencies, scaled as `config.rope_scaling` asks (float32, like HF)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
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


def rope_angles(positions_BL: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin of every position's angles, `[B, L, H/2]` float32."""
    inv_freq = jnp.asarray(inverse_frequencies(config))
    angles = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BLNH: jax.Array, cos_BLh: jax.Array, sin_BLh: jax.Array) -> jax.Array:
    """Rotates the two halves of the head dimension (HF `rotate_half` layout, not interleaved)."""
    x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos_BLh[:, :, None, :], sin_BLh[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLNH.dtype)
