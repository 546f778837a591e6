"""QLoRA's frozen base: layer matrices stored as int8 or NF4 codes with per-block absmax scales.

A layer weight `W [*lead, *in, *out]` (lead: the stacked `layers`, and `experts` for MoE
experts; in/out: `dense`'s contraction layout, as for the adapters) is quantised in blocks of
`block` consecutive elements along its LAST input dim, `axis = -(len(out) + 1)`: q
`[T, D, N, H]` along D (axis -3), o `[T, N, H, D]` along H (-2), mlp down `[T, F, D]` along F
(-2), experts up `[T, E, D, F]` along D (-2), MLA kv_b `[T, kv_lora, N, Hk + Hv]` along kv_lora
(-3). The axis is stored negative so it still names the same dim inside the layer scan, which
slices the leading `layers` dim off every leaf.

- int8: symmetric, `codes = round(127 * W / absmax)`, error at most half a step
  (absmax / 254). Default block: the whole axis (one absmax per output channel).
- nf4: the QLoRA paper's 4-bit NormalFloat (Dettmers et al. 2023, arXiv:2305.14314): each
  `W / absmax` becomes the index of the nearest of 16 levels, two indices per uint8 (first
  element in the high nibble, as bitsandbytes), packed along `axis`. Default block: 64.

A block larger than the axis is clamped to the axis; a block that does not divide it raises a
ValueError naming the weight and a block that would (no silent fallback: the block sets both
the error and the scale memory). Embeddings, lm_head, norms, biases and MoE routers stay as
they are. The model dequantises one layer at a time inside its scan:
`forward(qparams, ..., layer_transform=lambda p, extra: dequantize_tree(p))`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import ModelConfig, ParamSpec, param_axes, param_shapes, param_specs
from posttrain.parallel import named_sharding, tree_shardings

QUANT_FORMATS = ("int8", "nf4")
# The scanned layer stacks (embed and lm_head are neither quantised nor adapted) and the lead
# dims of their weights (`_adapters` shares these).
STACKS = ("layers", "dense_layers")
LEAD_AXES = ("layers", "experts")
DEFAULT_BLOCK = {"int8": 0, "nf4": 64}  # 0: the whole axis

# NormalFloat4: quantiles of N(0, 1) rescaled to [-1, 1], 0 exact (QLoRA paper, appendix E;
# bitsandbytes `functional.get_4bit_type("nf4")` lists these float32 values).
NF4_CODEBOOK = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
# Midpoints between neighbouring levels: the nearest level is the number of midpoints below.
_NF4_MIDPOINTS = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scale"],
    meta_fields=["format", "axis", "block", "dtype"],
)
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight stored as codes and per-block absmax scales; a pytree of `codes` and `scale`.

    For a weight of shape `S` with `n = S[axis]`:
    """

    # int8: int8 of shape S. nf4: uint8 of shape S with S[axis] halved (two codes per byte).
    codes: jax.Array
    scale: jax.Array  # float32 absmax of each block: S with S[axis] replaced by n // block
    format: str  # "int8" or "nf4"
    axis: int  # negative index of the blocked (last input) dim
    block: int  # elements per block along `axis` (the effective one: divides n)
    dtype: str  # the weight's dtype name, which `dequantize` returns

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantised weight's shape."""
        shape = list(self.codes.shape)
        if self.format == "nf4":
            shape[self.axis] *= 2
        return tuple(shape)


def _check_format(format: str) -> None:
    if format not in QUANT_FORMATS:
        raise ValueError(f"quantisation format {format!r}: choose one of {QUANT_FORMATS}")


def _block_size(shape: tuple[int, ...], format: str, axis: int, block: int) -> int:
    """The block along `axis`: 0 gives the format's default, the axis size caps it."""
    _check_format(format)
    n = shape[axis]
    block = block or DEFAULT_BLOCK[format] or n
    if block < 1:
        raise ValueError(f"block={block}: must be >= 1 (or 0 for the format's default)")
    block = min(block, n)
    if n % block:
        fits = max(d for d in range(1, block + 1) if n % d == 0)
        raise ValueError(
            f"block {block} does not divide dim {axis} (size {n}) of the {shape} weight; "
            f"use a block that divides {n}, e.g. {fits}"
        )
    if format == "nf4" and n % 2:
        raise ValueError(
            f"nf4 packs two codes per byte along dim {axis}, whose size {n} is odd "
            f"(weight {shape}); use int8 for it"
        )
    return block


def _blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """`[..., n, ...]` -> `[..., n // block, block, ...]` at `axis` (negative)."""
    ax = x.ndim + axis
    return x.reshape(*x.shape[:ax], x.shape[ax] // block, block, *x.shape[ax + 1 :])


def quantize_weight(w: jax.Array, format: str, axis: int, block: int) -> QuantizedWeight:
    """Quantises `w` in blocks along `axis`.

    Args:
      w: the weight, any float dtype (quantised in float32).
      format: "int8" or "nf4".
      axis: the blocked dim, negative (-ndim <= axis < 0).
      block: elements per block along `axis`; 0 for the format's default (int8: the whole axis,
        nf4: 64); capped at the axis size; must divide it.

    Returns:
      The `QuantizedWeight`; `dequantize` gives back `w`'s shape and dtype.
    """
    if not -w.ndim <= axis < 0:
        raise ValueError(f"axis={axis}: give a negative dim of the {w.shape} weight")
    block = _block_size(tuple(w.shape), format, axis, block)
    x = _blocked(w.astype(jnp.float32), axis, block)
    absmax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)  # reduces the block dim
    x = x / jnp.where(absmax == 0, 1.0, absmax)  # an all-zero block: codes 0, scale 0
    x = x.reshape(w.shape)
    scale = jnp.squeeze(absmax, axis)
    if format == "int8":
        codes = jnp.clip(jnp.round(x * 127), -127, 127).astype(jnp.int8)
    else:
        idx = jnp.zeros(x.shape, jnp.uint8)
        for mid in _NF4_MIDPOINTS:  # one fused elementwise pass, no [..., 16] temporary
            idx += (x > mid).astype(jnp.uint8)
        pairs = _blocked(idx, axis, 2)  # [..., n // 2, 2, ...]
        ax = pairs.ndim + axis  # the pair dim
        hi = jax.lax.index_in_dim(pairs, 0, ax, keepdims=False)
        lo = jax.lax.index_in_dim(pairs, 1, ax, keepdims=False)
        codes = (hi << 4) | lo
    return QuantizedWeight(codes, scale, format, axis, block, jnp.dtype(w.dtype).name)


def dequantize(q: QuantizedWeight) -> jax.Array:
    """The weight `q` stands for, computed in float32 and cast to its original dtype.

    Works on a stacked weight and on one layer's slice (the scan drops leading dims of `codes`
    and `scale` alike; `axis` counts from the end).
    """
    if q.format == "int8":
        x = q.codes.astype(jnp.float32) / 127
    else:
        codes = q.codes
        ax = codes.ndim + q.axis
        pairs = jnp.stack([codes >> 4, codes & 0xF], axis=ax + 1)  # [..., n // 2, 2, ...]
        idx = pairs.reshape(*codes.shape[:ax], 2 * codes.shape[ax], *codes.shape[ax + 1 :])
        x = jnp.zeros(idx.shape, jnp.float32)  # level 7 is 0.0
        for i, level in enumerate(NF4_CODEBOOK):  # selects, which fuse (a gather may not)
            if level:
                x = jnp.where(idx == i, level, x)
    x = _blocked(x, q.axis, q.block) * jnp.expand_dims(q.scale, q.axis)
    return x.reshape(q.shape).astype(q.dtype)


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantize_tree(tree):
    """Every `QuantizedWeight` of `tree` replaced by its dequantised array (QLoRA's
    `base_transform` for one layer's params); other leaves unchanged."""
    return jax.tree.map(
        lambda x: dequantize(x) if _is_quantized(x) else x, tree, is_leaf=_is_quantized
    )


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def in_dims(path: tuple[str, ...]) -> int:
    """Contracted dims of a layer weight: two for the projection out of heads (the decoder's
    attn/o, the vision encoder's o), else one."""
    return 2 if path[-2:] == ("attn", "o") or path in (("vision", "layers", "o"),) else 1


def _quant_axis(path: tuple[str, ...], spec: ParamSpec) -> int:
    """The last input dim of a layer weight, counted from the end."""
    lead = sum(1 for a in spec.axes if a in LEAD_AXES)
    n_out = len(spec.shape) - lead - in_dims(path)
    return -(n_out + 1)


def layer_matrices(model_config: ModelConfig) -> list[tuple[tuple[str, ...], ParamSpec]]:
    """(path, spec) of every matrix of the layer stacks, MoE routers excepted (norms, biases
    and the routing bias are not matrices). An NNX module's: every parameter of two or more
    dimensions that has no `vocab` axis (embeddings and output heads stay as they are)."""
    specs = param_specs(model_config)
    if model_config.nnx is not None:
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
        return [
            (tuple(k.key for k in keys), spec)
            for keys, spec in flat
            if len(spec.shape) >= 2 and "vocab" not in spec.axes
        ]
    found = []
    for stack in STACKS:
        if stack not in specs:
            continue
        flat = jax.tree_util.tree_flatten_with_path(specs[stack], is_leaf=is_spec)[0]
        for keys, spec in flat:
            path = (stack, *(k.key for k in keys))
            if spec.init == "normal" and path[-1] != "router":
                found.append((path, spec))
    return found


def quant_paths(model_config: ModelConfig) -> list[tuple[str, ...]]:
    """Paths (e.g. ("layers", "attn", "q")) of every weight QLoRA quantises: the layer
    matrices of `layers` / `dense_layers`, MoE routers excepted (routing stays exact)."""
    return [path for path, _ in layer_matrices(model_config)]


def _replace(tree: dict, path: tuple[str, ...], fn) -> dict:
    """A copy of the nested dict `tree` with the leaf at `path` replaced by `fn(leaf)`."""
    out = dict(tree)
    out[path[0]] = fn(tree[path[0]]) if len(path) == 1 else _replace(tree[path[0]], path[1:], fn)
    return out


def quantize_params(params: dict, model_config: ModelConfig, format: str, block: int = 0) -> dict:
    """The params with every `quant_paths` weight replaced by its `QuantizedWeight`.

    Args:
      params: the model's params (`init_params`, `from_hf`), float32 or bfloat16.
      model_config: the model.
      format: "int8" or "nf4" (static under jit, as `block`).
      block: elements per block along each weight's last input dim; 0 for the format's
        default (int8: the whole dim, nf4: 64); capped at the dim, must divide it.

    Returns:
      A params pytree to pass to `forward` with `dequantize_tree` as the layer transform.
    """
    _check_format(format)
    out = params
    for path, spec in layer_matrices(model_config):
        axis = _quant_axis(path, spec)
        try:
            _block_size(spec.shape, format, axis, block)
        except ValueError as e:
            raise ValueError(f"{'/'.join(path)}: {e}") from None
        out = _replace(out, path, lambda w, axis=axis: quantize_weight(w, format, axis, block))
    return out


def quantized_shapes(model_config: ModelConfig, format: str, block: int = 0) -> dict:
    """`jax.ShapeDtypeStruct`s of `quantize_params` (nothing allocated)."""
    fn = functools.partial(quantize_params, model_config=model_config, format=format, block=block)
    return jax.eval_shape(fn, param_shapes(model_config))


def quantized_shardings(model_config: ModelConfig, format: str, block: int, mesh) -> dict:
    """NamedShardings of `quantize_params`'s output under the active logical-axis rules.

    `codes` and `scale` take the logical axes of the weight they replace (a dim that no longer
    divides its mesh axes, as a scale's block dim, is replicated); the rest as the params.
    """
    shapes = quantized_shapes(model_config, format, block)
    axes = param_axes(model_config)
    out = tree_shardings(axes, param_shapes(model_config), mesh)
    for path in quant_paths(model_config):
        q, ax = shapes, axes
        for key in path:
            q, ax = q[key], ax[key]
        sharded = dataclasses.replace(
            q,
            codes=named_sharding(ax, q.codes.shape, mesh),
            scale=named_sharding(ax, q.scale.shape, mesh),
        )
        out = _replace(out, path, lambda _, s=sharded: s)
    return out


def param_bytes(tree) -> int:
    """Bytes of every array leaf of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(
        int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )
