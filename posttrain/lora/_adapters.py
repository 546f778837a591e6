"""Adapter params derived from the model's param table, and merging them into the base.

A targeted weight `W [*lead, *in, *out]` (lead: the stacked `layers`, and `experts` for MoE
experts; in/out: `dense`'s contraction layout, e.g. q `[T, D, N, H]` has in (D,), out (N, H)
and o `[T, N, H, D]` has in (N, H), out (D,)) gets `a [*lead, r, *in]` and `b [*lead, r, *out]`
with the base's logical axes (r replicated), so adapters shard like the weights they adapt.
`r` is the major dim of both, as in PEFT's `lora_A [r, in]`.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp

from posttrain.config import ConfigError
from posttrain.lora._config import LoRAConfig
from posttrain.lora._quant import LEAD_AXES, dequantize_tree, in_dims, is_spec, layer_matrices
from posttrain.models import ModelConfig, ParamSpec, param_specs
from posttrain.parallel import tree_shardings

_VISION_MATRICES = ("q", "k", "v", "o", "fc1", "fc2")


def _adaptable(model_config: ModelConfig) -> list[tuple[str, ...]]:
    """The layer matrices, plus a VLM's encoder-layer matrices ("vision/layers/q", ...: no
    default target matches them, so a LoRA run keeps the tower frozen unless asked)."""
    paths = [path for path, _ in layer_matrices(model_config)]
    if model_config.vision is not None and model_config.nnx is None:
        paths += [("vision", "layers", name) for name in _VISION_MATRICES]
    return paths


def target_paths(model_config: ModelConfig, lora: LoRAConfig) -> list[tuple[str, ...]]:
    """Paths (e.g. ("layers", "attn", "q"), ("vision", "layers", "v")) of every weight the
    config's targets match (layer matrices only: norms, biases, routers, embed and lm_head are
    never adapted)."""
    found = [
        path
        for path in _adaptable(model_config)
        if any(re.search(p, "/".join(path)) for p in lora.targets)
    ]
    if not found:
        raise ConfigError(
            f"lora.targets={list(lora.targets)} match no layer weight of {model_config.name}; "
            "paths look like 'layers/attn/q', 'layers/mlp/down', 'layers/moe/experts/up'"
        )
    return found


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def adapter_specs(model_config: ModelConfig, lora: LoRAConfig) -> dict:
    """`{stack: {...: {"a": ParamSpec, "b": ParamSpec}}}` for every target."""
    specs = param_specs(model_config)
    out: dict = {}
    for path in target_paths(model_config, lora):
        spec = _get(specs, path)
        lead = sum(1 for a in spec.axes if a in LEAD_AXES)
        n_in = in_dims(path)
        shape, axes = spec.shape, spec.axes
        a = ParamSpec(
            (*shape[:lead], lora.rank, *shape[lead : lead + n_in]),
            (*axes[:lead], None, *axes[lead : lead + n_in]),
            "lora_a",
        )
        b = ParamSpec(
            (*shape[:lead], lora.rank, *shape[lead + n_in :]),
            (*axes[:lead], None, *axes[lead + n_in :]),
            "zeros",
        )
        _set(out, path, {"a": a, "b": b})
    return out


def adapter_axes(model_config: ModelConfig, lora: LoRAConfig) -> dict:
    return jax.tree.map(lambda s: s.axes, adapter_specs(model_config, lora), is_leaf=is_spec)


def adapter_shapes(model_config: ModelConfig, lora: LoRAConfig) -> dict:
    """`jax.ShapeDtypeStruct`s of the adapters (float32: they are what the optimizer trains)."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
        adapter_specs(model_config, lora),
        is_leaf=is_spec,
    )


def adapter_shardings(model_config: ModelConfig, lora: LoRAConfig, mesh) -> dict:
    """NamedShardings of the adapters under the active logical-axis rules."""
    return tree_shardings(
        adapter_axes(model_config, lora), adapter_shapes(model_config, lora), mesh
    )


def init_adapters(model_config: ModelConfig, lora: LoRAConfig, rng: jax.Array, mesh=None):
    """Fresh adapters: `a` uniform in +-1/sqrt(fan_in) (PEFT's kaiming-uniform), `b` zeros.

    With a mesh, each device creates only its shards.
    """
    specs = adapter_specs(model_config, lora)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)

    def init(rng):
        keys = jax.random.split(rng, len(leaves))
        out = []
        for key, spec in zip(keys, leaves, strict=True):
            if spec.init == "zeros":
                out.append(jnp.zeros(spec.shape, jnp.float32))
                continue
            lead = sum(1 for a in spec.axes if a in LEAD_AXES)
            bound = 1.0 / math.sqrt(math.prod(spec.shape[lead + 1 :]))
            # (drawn in [*lead, *in, r] order, then r moved in front of the input dims)
            draw_shape = (*spec.shape[:lead], *spec.shape[lead + 1 :], spec.shape[lead])
            a = jax.random.uniform(key, draw_shape, jnp.float32, -bound, bound)
            out.append(jnp.moveaxis(a, -1, lead))
        return jax.tree.unflatten(treedef, out)

    shardings = None if mesh is None else adapter_shardings(model_config, lora, mesh)
    return jax.jit(init, out_shardings=shardings)(rng)


def _is_adapter(x) -> bool:
    return isinstance(x, dict) and set(x) == {"a", "b"}


def delta(a: jax.Array, b: jax.Array, lead: int) -> jax.Array:
    """`a [*lead, r, *in]`^T `@ b [*lead, r, *out]` -> `[*lead, *in, *out]` in float32."""
    r = a.shape[lead]
    in_shape, out_shape = a.shape[lead + 1 :], b.shape[lead + 1 :]
    a2 = a.reshape(*a.shape[:lead], r, math.prod(in_shape)).astype(jnp.float32)
    b2 = b.reshape(*b.shape[:lead], r, math.prod(out_shape)).astype(jnp.float32)
    return jnp.matmul(jnp.swapaxes(a2, -1, -2), b2).reshape(*a.shape[:lead], *in_shape, *out_shape)


def merge_weight(w: jax.Array, adapter: dict, scale: float) -> jax.Array:
    """`w + scale * a^T b` (contracting r), added in float32 and stored back in `w`'s dtype (a
    zero `b` gives `w` bit for bit). Works on a stacked weight and on one layer's slice alike."""
    a, b = adapter["a"], adapter["b"]
    lead = a.ndim + b.ndim - 2 - w.ndim
    return (w.astype(jnp.float32) + scale * delta(a, b, lead)).astype(w.dtype)


def _merge_tree(params: dict, adapters, scale: float) -> dict:
    out = dict(params)
    for key, value in adapters.items():
        if _is_adapter(value):
            out[key] = merge_weight(params[key], value, scale)
        else:
            out[key] = _merge_tree(params[key], value, scale)
    return out


def lora_transform(lora: LoRAConfig):
    """The model's `layer_transform`: one layer's params, its quantised weights (QLoRA)
    dequantised, with its adapters (`extra`; None: none) merged in."""

    def transform(layer_params: dict, extra) -> dict:
        layer_params = dequantize_tree(layer_params)
        if extra is None:
            return layer_params
        return _merge_tree(layer_params, extra, lora.scale)

    return transform


def adapter_kwargs(lora: LoRAConfig, adapters: dict | None) -> dict:
    """`forward`/`hidden_states` keyword arguments that run the (possibly quantised) base with
    `adapters`, or with none (the base model itself: DPO's and RL's reference)."""
    return dict(layer_transform=lora_transform(lora), layer_extras=adapters)


def wrap(lora: LoRAConfig | None, base: dict | None, trained, *, adapters: bool = True):
    """`(params, forward kwargs)` of the model a loss runs: `trained` itself without LoRA;
    with it, the frozen `base` with the adapters `trained` (or with none: `adapters=False`)."""
    if lora is None:
        return trained, {}
    if not adapters:
        return base, adapter_kwargs(lora, None)
    if "vision" in trained:  # the (small) image encoder's adapters merge once, up front
        base = {**base, "vision": _merge_tree(base["vision"], trained["vision"], lora.scale)}
        trained = {k: v for k, v in trained.items() if k != "vision"}
    return base, adapter_kwargs(lora, trained)


def merge(base_params: dict, adapters: dict, lora: LoRAConfig) -> dict:
    """The base params (dequantised if stored quantised) with `W + (alpha / rank) * A^T B` for
    every adapted weight: plain params, for export, sampling and evaluation."""
    base_params = dequantize_tree(base_params)
    out = dict(base_params)
    for stack, tree in adapters.items():
        out[stack] = _merge_tree(base_params[stack], tree, lora.scale)
    return out
