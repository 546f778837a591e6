"""Image encoders: a SigLIP-style ViT and the projectors that turn its patch features into the
decoder's image-token embeddings (Gemma 3's pool-norm-project, LLaVA's two-layer MLP).

Images are float pixels `[B, I, H, W, C]` (channels last, normalised): each row's `I` image
slots fill that row's image-token placeholders in order, `tokens_per_image` each; slots a row
does not use are ignored. The encoder's layers are stacked and scanned like the decoder's and
carry the same logical axes, so one set of sharding rules places both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.models._components import VisionConfig
from posttrain.models._config import ModelConfig
from posttrain.models._ops import ParamSpec, dense, rms_norm
from posttrain.parallel import constrain


def vision_param_specs(v: VisionConfig, text_dim: int) -> dict:
    """The encoder's and projector's weights; encoder layers stacked on a leading `layers` dim."""
    W, M, T, P = v.width, v.mlp_dim, v.num_layers, v.patch_size
    N, H = v.num_heads, v.width // v.num_heads
    vec = lambda init="zeros": ParamSpec((T, W), ("layers", "embed"), init)  # noqa: E731
    layers = {
        "norm1": vec("ones"),
        "norm1_bias": vec(),
        "q": ParamSpec((T, W, N, H), ("layers", "embed", "heads", "head_dim")),
        "k": ParamSpec((T, W, N, H), ("layers", "embed", "heads", "head_dim")),
        "v": ParamSpec((T, W, N, H), ("layers", "embed", "heads", "head_dim")),
        "o": ParamSpec((T, N, H, W), ("layers", "heads", "head_dim", "embed")),
        "o_bias": vec(),
        "norm2": vec("ones"),
        "norm2_bias": vec(),
        "fc1": ParamSpec((T, W, M), ("layers", "embed", "mlp")),
        "fc1_bias": ParamSpec((T, M), ("layers", "mlp"), "zeros"),
        "fc2": ParamSpec((T, M, W), ("layers", "mlp", "embed")),
        "fc2_bias": vec(),
    }
    for name in ("q", "k", "v"):
        layers[f"{name}_bias"] = ParamSpec((T, N, H), ("layers", "heads", "head_dim"), "zeros")
    specs = {
        "patch": ParamSpec((P * P * v.channels, W), (None, "embed")),
        "patch_bias": ParamSpec((W,), ("embed",), "zeros"),
        "position": ParamSpec((v.num_patches, W), (None, "embed")),
        "layers": layers,
    }
    if v.final_norm:
        specs["final_norm"] = ParamSpec((W,), ("embed",), "ones")
        specs["final_norm_bias"] = ParamSpec((W,), ("embed",), "zeros")
    if v.projector == "gemma3":
        specs["projector"] = {
            "norm": ParamSpec((W,), (None,), "zeros"),  # (1 + w), as Gemma's norms
            "proj": ParamSpec((W, text_dim), ("mlp", "embed")),
        }
    else:
        specs["projector"] = {
            "fc1": ParamSpec((W, text_dim), ("mlp", "embed")),
            "fc2": ParamSpec((text_dim, text_dim), ("embed", "mlp")),
        }
        if v.projector_bias:
            specs["projector"]["fc1_bias"] = ParamSpec((text_dim,), ("embed",), "zeros")
            specs["projector"]["fc2_bias"] = ParamSpec((text_dim,), (None,), "zeros")
    return specs


def _layer_norm(x, scale, bias, eps):
    """LayerNorm in float32, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(x.dtype)


def _encoder_layer(x_IPW, p, v: VisionConfig, dt):
    """One pre-norm ViT block: full (bidirectional) attention over the patches, then a GELU MLP."""
    h = _layer_norm(x_IPW, p["norm1"], p["norm1_bias"], v.norm_eps)
    q, k, val = (dense(h, p[n].astype(dt)) + p[f"{n}_bias"].astype(dt) for n in ("q", "k", "v"))
    o_IPNH = _full_attention(q, k, val, (v.width // v.num_heads) ** -0.5, dt)
    x_IPW = x_IPW + dense(o_IPNH, p["o"].astype(dt), contract=2) + p["o_bias"].astype(dt)
    h = _layer_norm(x_IPW, p["norm2"], p["norm2_bias"], v.norm_eps)
    h = jax.nn.gelu(dense(h, p["fc1"].astype(dt)) + p["fc1_bias"].astype(dt), approximate=True)
    return x_IPW + dense(h, p["fc2"].astype(dt)) + p["fc2_bias"].astype(dt)


_QUERY_CHUNK = 512  # queries scored at a time: [I, N, 512, P] scores, not [I, N, P, P]


def _full_attention(q_IPNH, k_IPNH, v_IPNH, scale: float, dt):
    """Softmax attention of every patch over every patch of its image; over many patches
    (Gemma 3's 4096) the queries go `_QUERY_CHUNK` at a time, each row's softmax whole, so
    the scores of one chunk are all that exist at once."""

    def attend(q):
        s = jnp.einsum("IPNH,IQNH->INPQ", q, k_IPNH, preferred_element_type=jnp.float32)
        a = jax.nn.softmax(s * scale, axis=-1).astype(dt)
        return jnp.einsum("INPQ,IQNH->IPNH", a, v_IPNH)

    I, P = q_IPNH.shape[:2]
    if P <= _QUERY_CHUNK or P % _QUERY_CHUNK:
        return attend(q_IPNH)
    chunks = q_IPNH.reshape(I, P // _QUERY_CHUNK, _QUERY_CHUNK, *q_IPNH.shape[2:]).swapaxes(0, 1)
    return jax.lax.map(attend, chunks).swapaxes(0, 1).reshape(q_IPNH.shape)


def patchify(images_IHWC: jax.Array, patch_size: int) -> jax.Array:
    """`[I, H, W, C]` -> `[I, (H/p)(W/p), p*p*C]`: row-major patches, each row-major pixels."""
    I, Hp, Wp, C = images_IHWC.shape
    h, w = Hp // patch_size, Wp // patch_size
    x = images_IHWC.reshape(I, h, patch_size, w, patch_size, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(I, h * w, patch_size * patch_size * C)


def encode_images(params: dict, images_BIHWC: jax.Array, config: ModelConfig) -> jax.Array:
    """The projected features `[B, I * tokens_per_image, D]` of every image slot, in order."""
    v, dt = config.vision, config.dtype
    B, I = images_BIHWC.shape[:2]
    side = v.image_size // v.patch_size
    if images_BIHWC.shape[2:] != (v.image_size, v.image_size, v.channels):
        raise ValueError(
            f"images of shape {images_BIHWC.shape[2:]}; this model takes "
            f"{(v.image_size, v.image_size, v.channels)} (posttrain.data.preprocess_images "
            "resizes them)"
        )
    x = patchify(images_BIHWC.reshape(B * I, *images_BIHWC.shape[2:]).astype(dt), v.patch_size)
    x = dense(x, params["patch"].astype(dt)) + params["patch_bias"].astype(dt)
    x = constrain(x + params["position"].astype(dt), ("act_batch", None, "act_embed"))
    layer = lambda x, p: (_encoder_layer(x, p, v, dt), None)  # noqa: E731
    if config.remat != "none":  # the decoder's remat choice: keep only each layer's input
        layer = jax.checkpoint(layer, prevent_cse=False)
    x, _ = jax.lax.scan(layer, x, params["layers"])
    if v.final_norm:
        x = _layer_norm(x, params["final_norm"], params["final_norm_bias"], v.norm_eps)
    p = params["projector"]
    if v.projector == "gemma3":  # average-pool the patch grid to tokens_per_image, norm, project
        t = round(v.tokens_per_image**0.5)
        k = side // t
        x = x.reshape(B * I, t, k, t, k, v.width).astype(jnp.float32).mean((2, 4)).astype(dt)
        x = rms_norm(x.reshape(B * I, t * t, v.width), p["norm"], v.norm_eps, 1.0)
        x = dense(x, p["proj"].astype(dt))
    else:
        x = x[:, 1:] if v.drop_first_patch else x
        x = dense(x, p["fc1"].astype(dt)) + (p["fc1_bias"].astype(dt) if "fc1_bias" in p else 0)
        x = dense(jax.nn.gelu(x, approximate=False), p["fc2"].astype(dt))
        x = x + (p["fc2_bias"].astype(dt) if "fc2_bias" in p else 0)
    return x.reshape(B, I * v.tokens_per_image, -1)


def merge_images(x_BLD, tokens_BL, features_BTD, image_token_id: int) -> jax.Array:
    """`x_BLD` with each row's image-token placeholders replaced by that row's features, in
    order (placeholders beyond the features repeat the last one: the data keeps counts equal)."""
    is_image_BL = tokens_BL == image_token_id
    index_BL = jnp.clip(jnp.cumsum(is_image_BL, axis=1) - 1, 0, features_BTD.shape[1] - 1)
    picked_BLD = jnp.take_along_axis(features_BTD, index_BL[..., None], axis=1)
    return jnp.where(is_image_BL[..., None], picked_BLD.astype(x_BLD.dtype), x_BLD)


def image_blocks(tokens_BL: jax.Array, image_token_id: int) -> jax.Array:
    """Int32 `[B, L]`: each run of image tokens numbered 1, 2, ... in its row, 0 for text. A
    bidirectional VLM (Gemma 3) lets tokens of one run see each other both ways."""
    is_image = tokens_BL == image_token_id
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1), 0).astype(jnp.int32)
