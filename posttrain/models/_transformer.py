"""The decoder: parameters as a pytree with logical axis names, a scanned stack of layers.

One table (`param_specs`) declares every weight's shape, logical axes and initialiser; init,
sharding, abstract shapes and HF conversion all read it. The forward pass is a pure function of
(params, tokens); `Transformer` pairs params with their config so a model is `model(tokens)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models._attention import attention, resolve_impl
from posttrain.models._config import ModelConfig
from posttrain.models._rope import apply_rope, rope_angles
from posttrain.parallel import constrain, tree_shardings


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight: its shape, the logical name of each dimension and how to initialise it."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" (std 0.02), "ones" or "zeros"


def param_specs(config: ModelConfig) -> dict:
    """The table of every parameter; layer weights carry a leading `layers` dimension T."""
    c = config
    T, D, N, K, H, F, V = (
        c.num_layers,
        c.embed_dim,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.mlp_dim,
        c.vocab_size,
    )
    attn = {
        "q": ParamSpec((T, D, N, H), ("layers", "embed", "heads", "head_dim")),
        "k": ParamSpec((T, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "v": ParamSpec((T, D, K, H), ("layers", "embed", "kv_heads", "head_dim")),
        "o": ParamSpec((T, N, H, D), ("layers", "heads", "head_dim", "embed")),
    }
    if c.qkv_bias:
        attn["q_bias"] = ParamSpec((T, N, H), ("layers", "heads", "head_dim"), "zeros")
        attn["k_bias"] = ParamSpec((T, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
        attn["v_bias"] = ParamSpec((T, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
    if c.o_bias:
        attn["o_bias"] = ParamSpec((T, D), ("layers", "embed"), "zeros")
    if c.qk_norm:
        attn["q_norm"] = ParamSpec((T, H), ("layers", "head_dim"), "ones")
        attn["k_norm"] = ParamSpec((T, H), ("layers", "head_dim"), "ones")
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": {
            "attn_norm": ParamSpec((T, D), ("layers", "embed"), "ones"),
            "attn": attn,
            "mlp_norm": ParamSpec((T, D), ("layers", "embed"), "ones"),
            "mlp": {
                "gate": ParamSpec((T, D, F), ("layers", "embed", "mlp")),
                "up": ParamSpec((T, D, F), ("layers", "embed", "mlp")),
                "down": ParamSpec((T, F, D), ("layers", "mlp", "embed")),
            },
        },
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not c.tie_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def param_axes(config: ModelConfig) -> dict:
    """Pytree of logical axis tuples, parallel to the params."""
    return jax.tree.map(lambda s: s.axes, param_specs(config), is_leaf=_is_spec)


def param_shapes(config: ModelConfig) -> dict:
    """Pytree of `jax.ShapeDtypeStruct`: the params without allocating them."""
    dtype = jnp.dtype(config.param_dtype)
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(config), is_leaf=_is_spec
    )


def param_shardings(config: ModelConfig, mesh) -> dict:
    """NamedSharding of every parameter on `mesh` under the active logical-axis rules."""
    return tree_shardings(param_axes(config), param_shapes(config), mesh)


def init_params(config: ModelConfig, rng: jax.Array, mesh=None) -> dict:
    """Random parameters; with a mesh each device builds only its own shards.

    Args:
      config: the model.
      rng: a PRNG key.
      mesh: if given, params are created already sharded (jit with `out_shardings`), so no
        device ever holds a full replica.

    Returns:
      The params pytree, in `config.param_dtype`.
    """
    specs = param_specs(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    dtype = jnp.dtype(config.param_dtype)

    def init(rng):
        keys = jax.random.split(rng, len(leaves))
        out = []
        for key, spec in zip(keys, leaves, strict=True):
            if spec.init == "ones":
                out.append(jnp.ones(spec.shape, dtype))
            elif spec.init == "zeros":
                out.append(jnp.zeros(spec.shape, dtype))
            else:
                out.append((0.02 * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype))
        return jax.tree.unflatten(treedef, out)

    shardings = None if mesh is None else param_shardings(config, mesh)
    return jax.jit(init, out_shardings=shardings)(rng)


def dense(x, w, contract: int = 1, preferred_element_type=None):
    """`x[..., *in] @ w[*in, *out]` over the last `contract` dims of x, as one 2-D matmul.

    Same result as the einsum, but XLA:CPU runs flat matmuls several times faster than
    multi-dimensional einsums (their gradients need transposing copies); on TPU and GPU
    the reshapes are free.
    """
    lead, inner = x.shape[: x.ndim - contract], x.shape[x.ndim - contract :]
    out = w.shape[contract:]
    y = jnp.dot(
        x.reshape(-1, math.prod(inner)),
        w.reshape(math.prod(inner), -1),
        preferred_element_type=preferred_element_type,
    )
    return y.reshape(*lead, *out)


def rms_norm(x, scale, eps: float):
    """HF-exact RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


_REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing, recompute the whole layer
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_TBSKH", "v_TBSKH", "positions_BS", "segment_ids_BS", "index"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer for S slots per row, for incremental decoding.

    A forward pass with a cache writes its L tokens' keys, values, positions and segment ids at
    slots `index .. index+L-1` of every row and attends over all S slots (masked by position and
    segment id, so slots never written, with segment id -1, are never seen).
    """

    k_TBSKH: jax.Array
    v_TBSKH: jax.Array
    positions_BS: jax.Array  # int32 position of the token in each slot
    segment_ids_BS: jax.Array  # int32; -1 marks a slot never written
    index: jax.Array  # int32 scalar: the slot the next tokens are written at

    @classmethod
    def init(cls, config: ModelConfig, batch: int, length: int) -> KVCache:
        """An empty cache of `length` slots per row, in the compute dtype."""
        shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
        return cls(
            k_TBSKH=jnp.zeros(shape, config.dtype),
            v_TBSKH=jnp.zeros(shape, config.dtype),
            positions_BS=jnp.zeros((batch, length), jnp.int32),
            segment_ids_BS=jnp.full((batch, length), -1, jnp.int32),
            index=jnp.zeros((), jnp.int32),
        )


def _layer(
    x_BLD,
    p,
    window_index,
    k_cache_BSKH=None,
    v_cache_BSKH=None,
    *,
    config: ModelConfig,
    impl: str,
    windows: tuple[int, ...],
    cos,
    sin,
    positions_BL,
    segment_ids_BL,
    kv_positions_BS=None,
    kv_segment_ids_BS=None,
    cache_index=None,
):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    With a cache (`k_cache_BSKH` ...), the new keys and values are written at `cache_index` and
    the queries attend over the whole cache; the updated (k, v) cache is the second output.
    """
    dt = config.dtype
    a = p["attn"]
    h_BLD = rms_norm(x_BLD, p["attn_norm"], config.norm_eps)
    q_BLNH = dense(h_BLD, a["q"].astype(dt))
    k_BLKH = dense(h_BLD, a["k"].astype(dt))
    v_BLKH = dense(h_BLD, a["v"].astype(dt))
    if config.qkv_bias:
        q_BLNH += a["q_bias"].astype(dt)
        k_BLKH += a["k_bias"].astype(dt)
        v_BLKH += a["v_bias"].astype(dt)
    if config.qk_norm:
        q_BLNH = rms_norm(q_BLNH, a["q_norm"], config.norm_eps)
        k_BLKH = rms_norm(k_BLKH, a["k_norm"], config.norm_eps)
    q_BLNH = constrain(apply_rope(q_BLNH, cos, sin), ("act_batch", "act_length", "act_heads", None))
    k_BLKH = constrain(
        apply_rope(k_BLKH, cos, sin), ("act_batch", "act_length", "act_kv_heads", None)
    )
    v_BLKH = constrain(v_BLKH, ("act_batch", "act_length", "act_kv_heads", None))

    new_cache = None
    if k_cache_BSKH is None:
        kv_positions_BS, kv_segment_ids_BS = positions_BL, segment_ids_BL
    else:  # the fused kernels assume self-attention; cache attention uses the XLA reference
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=cache_index)
        k_BLKH = write(k_cache_BSKH, k_BLKH.astype(k_cache_BSKH.dtype), axis=1)
        v_BLKH = write(v_cache_BSKH, v_BLKH.astype(v_cache_BSKH.dtype), axis=1)
        new_cache, impl = (k_BLKH, v_BLKH), "xla"
    attend = [
        functools.partial(
            attention,
            window=w,
            impl=impl,
            q_positions_BL=positions_BL,
            kv_positions_BS=kv_positions_BS,
            q_segment_ids_BL=segment_ids_BL,
            kv_segment_ids_BS=kv_segment_ids_BS,
            self_attention=k_cache_BSKH is None,
        )
        for w in windows
    ]
    if len(attend) == 1:
        o_BLNH = attend[0](q_BLNH, k_BLKH, v_BLKH)
    else:  # layers differ in window size: pick this layer's statically-compiled variant
        o_BLNH = jax.lax.switch(window_index, attend, q_BLNH, k_BLKH, v_BLKH)
    attn_BLD = dense(o_BLNH, a["o"].astype(dt), contract=2)
    if config.o_bias:
        attn_BLD += a["o_bias"].astype(dt)
    x_BLD = constrain(x_BLD + attn_BLD, ("act_batch", "act_length", "act_embed"))

    m = p["mlp"]
    h_BLD = rms_norm(x_BLD, p["mlp_norm"], config.norm_eps)
    gate_BLF = dense(h_BLD, m["gate"].astype(dt))
    up_BLF = dense(h_BLD, m["up"].astype(dt))
    act_BLF = constrain(jax.nn.silu(gate_BLF) * up_BLF, ("act_batch", "act_length", "act_mlp"))
    x_BLD = x_BLD + dense(act_BLF, m["down"].astype(dt))
    return constrain(x_BLD, ("act_batch", "act_length", "act_embed")), new_cache


def hidden_states(
    params: dict,
    tokens_BL: jax.Array,
    config: ModelConfig,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    cache: KVCache | None = None,
):
    """The final-normed residual stream `[B, L, D]` (what heads such as lm_head read).

    With a `cache`, returns `(hidden, cache)`: the tokens' keys and values are written at
    `cache.index` and attention runs over the cache (see `KVCache`).
    """
    B, L = tokens_BL.shape
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if segment_ids_BL is None:
        segment_ids_BL = jnp.ones((B, L), jnp.int32)
    dt = config.dtype
    # FSDP: gather the table's model dimension before the lookup (as for any weight), so the
    # gathered rows come out sharded by batch instead of being resharded from the table's layout.
    embed_VD = constrain(params["embed"], ("vocab", None))
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(dt)
    x_BLD = constrain(x_BLD, ("act_batch", "act_length", "act_embed"))
    cos, sin = rope_angles(positions_BL, config)

    windows = tuple(sorted(set(config.layer_windows)))
    window_index_T = jnp.asarray([windows.index(w) for w in config.layer_windows], jnp.int32)
    xs = (params["layers"], window_index_T)
    cache_kwargs = {}
    if cache is not None:
        xs += (cache.k_TBSKH, cache.v_TBSKH)
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=cache.index)
        cache_kwargs = dict(
            kv_positions_BS=write(cache.positions_BS, positions_BL.astype(jnp.int32), axis=1),
            kv_segment_ids_BS=write(cache.segment_ids_BS, segment_ids_BL.astype(jnp.int32), axis=1),
            cache_index=cache.index,
        )
    layer = functools.partial(
        _layer,
        config=config,
        impl=resolve_impl(config.attention),
        windows=windows,
        cos=cos,
        sin=sin,
        positions_BL=positions_BL,
        segment_ids_BL=segment_ids_BL,
        **cache_kwargs,
    )
    if config.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
    x_BLD, kv = jax.lax.scan(lambda x, xs: layer(x, *xs), x_BLD, xs)
    hidden_BLD = rms_norm(x_BLD, params["final_norm"], config.norm_eps)
    if cache is None:
        return hidden_BLD
    cache = KVCache(
        k_TBSKH=kv[0],
        v_TBSKH=kv[1],
        positions_BS=cache_kwargs["kv_positions_BS"],
        segment_ids_BS=cache_kwargs["kv_segment_ids_BS"],
        index=cache.index + L,
    )
    return hidden_BLD, cache


def lm_logits(params: dict, hidden_BLD: jax.Array, config: ModelConfig) -> jax.Array:
    """Vocabulary logits `[B, L, V]` in float32 from final hidden states."""
    dt = config.dtype
    head_DV = params["embed"].T if config.tie_embeddings else params["lm_head"]
    logits = dense(hidden_BLD, head_DV.astype(dt), preferred_element_type=jnp.float32)
    return constrain(logits, ("act_batch", "act_length", "act_vocab"))


def forward(
    params: dict,
    tokens_BL: jax.Array,
    config: ModelConfig,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    cache: KVCache | None = None,
):
    """Logits `[B, L, V]` (float32) for int32 tokens `[B, L]`; `(logits, cache)` with a cache.

    Args:
      params: the params pytree (`init_params`, `from_hf`).
      tokens_BL: token ids.
      config: the model config.
      positions_BL: RoPE positions; default `0..L-1` in every row. Packed rows restart at 0 for
        each document.
      segment_ids_BL: packed-document ids; tokens attend only within their document. Default:
        one document per row. Padding may use any id of its own (0 by convention).
      cache: a `KVCache` to write these tokens into and attend over (incremental decoding);
        the updated cache is returned with the logits.
    """
    out = hidden_states(params, tokens_BL, config, positions_BL, segment_ids_BL, cache)
    if cache is None:
        return lm_logits(params, out, config)
    return lm_logits(params, out[0], config), out[1]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class Transformer:
    """A model is its config plus its params: `model(tokens) -> logits`. A pytree, so it can be
    passed through `jax.jit` (the config is static)."""

    params: dict
    config: ModelConfig

    def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, cache=None):
        return forward(self.params, tokens_BL, self.config, positions_BL, segment_ids_BL, cache)

    def hidden_states(self, tokens_BL, positions_BL=None, segment_ids_BL=None, cache=None):
        return hidden_states(
            self.params, tokens_BL, self.config, positions_BL, segment_ids_BL, cache
        )

    @classmethod
    def init(cls, config: ModelConfig, rng: jax.Array | int = 0, mesh=None) -> Transformer:
        """A randomly initialised model (sharded over `mesh` if given)."""
        if isinstance(rng, int | np.integer):
            rng = jax.random.key(int(rng))
        return cls(init_params(config, rng, mesh), config)
