"""The parameter table: every weight's shape, logical axes and initialiser (`param_specs`), and
what is derived from it: abstract shapes, shardings, counts and random init. HF conversion
(`_hf_table`) and the MTP module (`_mtp`) read the same per-layer block specs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posttrain.models._config import ModelConfig
from posttrain.models._mla import mla_param_specs
from posttrain.models._moe import moe_param_specs
from posttrain.models._nnx import nnx_init, nnx_param_specs
from posttrain.models._ops import ParamSpec
from posttrain.models._vision import vision_param_specs
from posttrain.parallel import tree_shardings


def _attention_specs(c: ModelConfig, T: int) -> dict:
    if c.mla is not None:
        return mla_param_specs(c, T)
    D, N, K, H = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
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
        attn["q_norm"] = ParamSpec((T, H), ("layers", "head_dim"), _norm_init(c))
        attn["k_norm"] = ParamSpec((T, H), ("layers", "head_dim"), _norm_init(c))
    return attn


def _norm_init(c: ModelConfig) -> str:
    """Norm weights start as the identity: 1, or 0 under Gemma's `offset + weight`."""
    return "zeros" if c.norm_offset == 1 else "ones"


def _block_specs(c: ModelConfig, T: int, moe: bool) -> dict:
    """T stacked pre-norm blocks: attention, then a dense SwiGLU (`mlp`) or experts (`moe`);
    with `post_norms` also a norm on each one's output."""
    D, F = c.embed_dim, c.mlp_dim
    norm = ParamSpec((T, D), ("layers", "embed"), _norm_init(c))
    block = {"attn_norm": norm, "attn": _attention_specs(c, T), "mlp_norm": norm}
    if c.post_norms:
        block["attn_post_norm"] = block["mlp_post_norm"] = norm
    if moe:
        block["moe"] = moe_param_specs(c.moe, D, T)
    else:
        block["mlp"] = {
            "gate": ParamSpec((T, D, F), ("layers", "embed", "mlp")),
            "up": ParamSpec((T, D, F), ("layers", "embed", "mlp")),
            "down": ParamSpec((T, F, D), ("layers", "mlp", "embed")),
        }
    return block


def param_specs(config: ModelConfig) -> dict:
    """The table of every parameter; layer weights carry a leading `layers` dimension T.

    `layers` stacks every layer of a dense model. With MoE it stacks the expert layers, and
    `dense_layers` the first `first_k_dense` ones (a separate scan: their shapes differ).
    """
    c = config
    if c.nnx is not None:  # your own Flax module: its parameters and their metadata
        return nnx_param_specs(c.nnx)
    D, V = c.embed_dim, c.vocab_size
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": _block_specs(c, c.num_layers - c.first_k_dense, moe=c.moe is not None),
        "final_norm": ParamSpec((D,), ("embed",), _norm_init(c)),
    }
    if c.first_k_dense:
        specs["dense_layers"] = _block_specs(c, c.first_k_dense, moe=False)
    if not c.tie_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    if c.vision is not None:
        specs["vision"] = vision_param_specs(c.vision, D)
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


def num_params(config: ModelConfig) -> int:
    """Parameter count, from shapes alone."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(config)))


def param_shardings(config: ModelConfig, mesh) -> dict:
    """NamedSharding of every parameter on `mesh` under the active logical-axis rules."""
    return table_shardings(param_specs(config), mesh)


def table_shardings(specs: dict, mesh) -> dict:
    """NamedSharding of every entry of a table of `ParamSpec`s on `mesh`."""
    axes = jax.tree.map(lambda s: s.axes, specs, is_leaf=_is_spec)
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), specs, is_leaf=_is_spec
    )
    return tree_shardings(axes, shapes, mesh)


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

    if config.nnx is not None:  # the module's own initialisers

        def init(rng):
            return nnx_init(config.nnx, rng)

    shardings = None if mesh is None else param_shardings(config, mesh)
    return jax.jit(init, out_shardings=shardings)(rng)


def split_layers(stack, num_layers: int) -> tuple:
    """A pytree stacked over layers (a layer stack's params, a KV pool) as a tuple of per-layer
    pytrees; `jax.tree.map(lambda *a: jnp.stack(a), *layers)` stacks them back."""
    return tuple(jax.tree.map(lambda a, i=i: a[i], stack) for i in range(num_layers))


def unstack_layers(params: dict) -> dict:
    """The params with each layer stack ("dense_layers", "layers") as a tuple of per-layer
    params; `hidden_states` (with a cache) then loops over them: no per-step slice (copy) of
    every layer's weights and cache, as a scan over the stacks makes at every decode step."""
    out = dict(params)
    for name in ("dense_layers", "layers"):
        if name in params:
            out[name] = split_layers(params[name], jax.tree.leaves(params[name])[0].shape[0])
    return out
