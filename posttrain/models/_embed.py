"""The decoder's input and output: token embeddings (Gemma scales them) with a VLM's image
features in place of its image tokens, and the vocabulary logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.models._config import ModelConfig
from posttrain.models._invariant import logits_rows
from posttrain.models._nnx import nnx_logits
from posttrain.models._ops import dense
from posttrain.models._vision import encode_images, merge_images
from posttrain.parallel import constrain


def embed(embed_VD: jax.Array, tokens_BL: jax.Array, dtype) -> jax.Array:
    """The token embeddings `[B, L, D]` in `dtype`."""
    # FSDP: gather the table's model dimension before the lookup (as for any weight), so the
    # gathered rows come out sharded by batch instead of being resharded from the table's layout.
    embed_VD = constrain(embed_VD, ("vocab", None))
    return jnp.take(embed_VD, tokens_BL, axis=0).astype(dtype)


def input_embeddings(
    params: dict,
    tokens_BL: jax.Array,
    config: ModelConfig,
    embeds_BLD: jax.Array | None = None,
    images_BIHWC: jax.Array | None = None,
) -> jax.Array:
    """The first layer's input `[B, L, D]`: `tokens_BL`'s embeddings (scaled by sqrt(D) for
    Gemma) or the given `embeds_BLD`, then each image token replaced by its image's feature
    (unscaled, as Gemma 3 does)."""
    dt = config.dtype
    if embeds_BLD is None:
        x_BLD = embed(params["embed"], tokens_BL, dt)
        if config.embed_scale:  # Gemma: sqrt(D), rounded to the compute dtype as HF does
            x_BLD = x_BLD * jnp.asarray(config.embed_dim**0.5, dt)
    else:
        x_BLD = embeds_BLD.astype(dt)
    if images_BIHWC is not None:
        if config.vision is None:
            raise ValueError(f"model {config.name!r} has no vision encoder; it takes no images")
        features_BTD = encode_images(params["vision"], images_BIHWC, config)
        x_BLD = merge_images(x_BLD, tokens_BL, features_BTD, config.vision.image_token_id)
    return constrain(x_BLD, ("act_batch", "act_length", "act_embed"))


def lm_logits(params: dict, hidden_BLD: jax.Array, config: ModelConfig) -> jax.Array:
    """Vocabulary logits `[B, L, V]` in float32 from final hidden states."""
    if config.nnx is not None:
        return nnx_logits(config.nnx, params, hidden_BLD)
    dt = config.dtype
    head_DV = params["embed"].T if config.tie_embeddings else params["lm_head"]
    if config.batch_invariant:
        logits = logits_rows(hidden_BLD, head_DV.astype(dt))
    else:
        logits = dense(hidden_BLD, head_DV.astype(dt), preferred_element_type=jnp.float32)
    if config.final_softcap:
        logits = config.final_softcap * jnp.tanh(logits / config.final_softcap)
    return constrain(logits, ("act_batch", "act_length", "act_vocab"))
