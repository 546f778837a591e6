"""Your own Flax NNX module as a posttrain model.

A builder, `package.module:function`, is called as `function(rngs=nnx.Rngs(key), **kwargs)` and
returns an `nnx.Module`. posttrain splits it into its graph and its `nnx.Param` state: the state
is the params pytree every method trains, shards, checkpoints and adapts (nested dicts keyed by
the module's attribute names, list indices as strings), and the graph is merged back with the
params inside each traced forward pass, so the module's own code runs unchanged.

The module's call contract (the adapter signature):

- `module(tokens_BL, positions_BL, segment_ids_BL) -> logits_BLV` (float logits): positions
  restart at 0 for each packed document, a token attends only to earlier tokens of its own
  segment id (padding has an id of its own).
- Optionally `module.hidden_states(tokens_BL, positions_BL, segment_ids_BL) -> h_BLD` and
  `module.logits(h_BLD) -> logits_BLV`: losses then compute the vocabulary logits a chunk at a
  time, and reward-model and critic heads read `h_BLD` (without them, heads read the logits).

Each parameter's logical axes come from its metadata (`nnx.with_partitioning(init, ("embed",
"mlp"))` or `nnx.Param(x, sharding=(...))`, Flax's `out_sharding`), mapped onto the mesh by
posttrain's logical-axis rules like posttrain's own weights; a parameter without metadata is
replicated.

Decoding (the paged engine: `generate`, RL rollouts, eval) keeps each row's tokens and runs
the module over them at each step, taking the new position's outputs: exact for any module,
O(length) work per step (a module has no KV-cache interface posttrain could call). `NNXCache`
is that buffer for one padded batch (`hidden_states(..., cache=)`, the tests' reference loop).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math

import jax
import jax.numpy as jnp

from posttrain.config import ConfigError
from posttrain.models._ops import ParamSpec
from posttrain.parallel import current_rules

_AXES_METADATA = ("out_sharding", "sharding", "sharding_names")  # Flax's names over versions


@dataclasses.dataclass(frozen=True)
class NNXSpec:
    """Which NNX module a model is: its builder and the builder's keyword arguments."""

    builder: str  # "package.module:function", called with rngs= and the kwargs
    kwargs: str = "{}"  # the keyword arguments as a JSON object (a string keeps configs hashable)

    @classmethod
    def of(cls, builder: str, kwargs: dict | None = None) -> NNXSpec:
        try:
            text = json.dumps(dict(kwargs or {}), sort_keys=True)
        except TypeError as e:
            raise ValueError(f"model.nnx_kwargs must be plain JSON values: {e}") from None
        return cls(builder, text)

    @property
    def arguments(self) -> dict:
        return json.loads(self.kwargs)


@dataclasses.dataclass(frozen=True)
class _Module:
    """What posttrain keeps of a module: its graph and, per parameter, its nnx path, abstract
    variable (shape, dtype, metadata) and path in the params pytree."""

    graphdef: object
    paths: tuple[tuple, ...]
    variables: tuple
    keys: tuple[tuple[str, ...], ...]
    split: bool  # has hidden_states() and logits()
    dtype: str  # the params' dtype (one for all)


def _builder(spec: NNXSpec):
    module_name, _, name = spec.builder.partition(":")
    if not module_name or not name:
        raise ConfigError(
            f"model.nnx={spec.builder!r}: give the builder as 'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except ImportError as e:
        raise ConfigError(
            f"model.nnx={spec.builder!r}: cannot import {module_name} ({e})"
        ) from None
    except AttributeError:
        raise ConfigError(f"model.nnx={spec.builder!r}: {module_name} has no {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"model.nnx={spec.builder!r} is not a function")
    return fn


def _build(spec: NNXSpec, rngs):
    from flax import nnx

    with nnx.use_eager_sharding(False):  # shardings are posttrain's (the rules), not Flax's
        try:
            module = _builder(spec)(rngs=rngs, **spec.arguments)
        except TypeError as e:
            raise ConfigError(
                f"model.nnx={spec.builder!r} with model.nnx_kwargs={spec.arguments}: {e}"
            ) from None
    if not isinstance(module, nnx.Module):
        raise ConfigError(f"model.nnx={spec.builder!r} returned {type(module).__name__}, not an "
                          "nnx.Module")  # fmt: skip
    return module


@functools.lru_cache(maxsize=32)
def _module(spec: NNXSpec) -> _Module:
    from flax import nnx

    # (jax.eval_shape, not nnx.eval_shape: that one turns the metadata into shardings of the
    # active mesh, whose axes are not the logical names)
    graphdef, params, rest = jax.eval_shape(
        lambda: nnx.split(_build(spec, nnx.Rngs(0)), nnx.Param, ...)
    )
    others = nnx.to_flat_state(rest)
    if len(others):
        names = ", ".join(f"{'/'.join(map(str, p))} ({type(v).__name__})" for p, v in others[:3])
        raise ConfigError(
            f"model.nnx={spec.builder!r} holds state that is not an nnx.Param: {names}; "
            "posttrain trains and checkpoints parameters only: build the module without stored "
            "Rngs (dropout off), batch statistics or caches"
        )
    flat = list(nnx.to_flat_state(params))
    dtypes = {str(v.get_value().dtype) for _, v in flat}
    if len(dtypes) != 1:
        raise ConfigError(
            f"model.nnx={spec.builder!r}: its parameters have several dtypes {sorted(dtypes)}; "
            "keep one parameter dtype (compute in another inside the module)"
        )
    cls = type(nnx.merge(graphdef, params, rest))
    split = callable(getattr(cls, "hidden_states", None)) and callable(getattr(cls, "logits", None))
    return _Module(
        graphdef=graphdef,
        paths=tuple(p for p, _ in flat),
        variables=tuple(v for _, v in flat),
        keys=tuple(tuple(str(k) for k in p) for p, _ in flat),
        split=split,
        dtype=dtypes.pop(),
    )


def _axes(spec: NNXSpec, key: tuple[str, ...], variable) -> tuple[str | None, ...]:
    ndim = len(variable.get_value().shape)
    meta = variable.get_metadata()
    names = next((meta[m] for m in _AXES_METADATA if meta.get(m) is not None), (None,) * ndim)
    names = tuple(names)
    where = f"model.nnx={spec.builder!r}: parameter {'/'.join(key)}"
    if len(names) != ndim:
        raise ConfigError(f"{where} has {ndim} dimensions but names {len(names)} axes {names}")
    known = dict(current_rules())
    for name in names:
        if name is not None and (not isinstance(name, str) or name not in known):
            raise ConfigError(
                f"{where} names logical axis {name!r}, which has no sharding rule; use one of "
                f"{sorted(known)} (or None to replicate that dimension)"
            )
    return names


def nnx_param_specs(spec: NNXSpec) -> dict:
    """The module's parameter table (shapes and logical axes), keyed like its params."""
    m = _module(spec)
    out: dict = {}
    for key, variable in zip(m.keys, m.variables, strict=True):
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = ParamSpec(tuple(variable.get_value().shape), _axes(spec, key, variable))
    return out


def nnx_init(spec: NNXSpec, rng: jax.Array) -> dict:
    """Random params from the module's own initialisers (trace under `jax.jit` with the
    params' `out_shardings`, so each device makes only its shards)."""
    from flax import nnx

    module = _build(spec, nnx.Rngs(rng))
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    values = {tuple(str(k) for k in p): v.get_value() for p, v in flat}
    out: dict = {}
    for key in _module(spec).keys:
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = values[key]
    return out


def _leaf(params: dict, key: tuple[str, ...], variable):
    """The params' entry at `key`; a parameter they leave out (a reward model's trunk has no
    LM head) is a zero stand-in, which XLA drops unless the pass reads it."""
    for k in key:
        if k not in params:
            value = variable.get_value()
            return jnp.zeros(value.shape, value.dtype)
        params = params[k]
    return params


def module_of(spec: NNXSpec, params: dict):
    """The module with `params` (arrays or tracers) as its parameters."""
    from flax import nnx

    m = _module(spec)
    state = nnx.from_flat_state(
        [
            (path, variable.replace(_leaf(params, key, variable)))
            for path, variable, key in zip(m.paths, m.variables, m.keys, strict=True)
        ]
    )
    return nnx.merge(m.graphdef, state)


def has_hidden_states(spec: NNXSpec) -> bool:
    """Whether the module gives hidden states and logits separately (see the module doc)."""
    return _module(spec).split


@functools.lru_cache(maxsize=32)
def nnx_describe(spec: NNXSpec) -> dict:
    """ModelConfig fields of the module: the vocabulary and width its outputs have, its
    parameter dtype, and its layer and head counts where it has those attributes (they size
    FLOP estimates only)."""
    m = _module(spec)
    params = jax.tree.map(  # (the sharding names are checked here, before any call)
        lambda s: jax.ShapeDtypeStruct(s.shape, m.dtype),
        nnx_param_specs(spec),
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )
    abstract = module_of(spec, params)
    tokens = jax.ShapeDtypeStruct((1, 2), jnp.int32)

    def shape(method: str):
        def call(params, t):
            module = module_of(spec, params)
            return getattr(module, method)(t, jnp.zeros_like(t), jnp.ones_like(t))

        name = "module" if method == "__call__" else f"module.{method}"
        try:
            out = jax.eval_shape(call, params, tokens)
        except Exception as e:  # the user's code: whatever it raises
            raise ConfigError(
                f"model.nnx={spec.builder!r}: calling {name}(tokens [1, 2], positions, "
                f"segment_ids) failed ({type(e).__name__}: "
                f"{str(e)[:200]}); posttrain calls it with int32 [B, L] tokens, positions and "
                "segment ids (docs/models.md, 'Your own Flax model')"
            ) from None
        if getattr(out, "ndim", 0) != 3 or out.shape[:2] != (1, 2):
            raise ConfigError(
                f"model.nnx={spec.builder!r}: {name} returned "
                f"{getattr(out, 'shape', type(out).__name__)} for tokens [1, 2]; it "
                "must return one [B, L, V] array (hidden_states: [B, L, D])"
            )
        return out.shape[-1]

    vocab = shape("__call__")
    width = shape("hidden_states") if m.split else vocab
    out = {"vocab_size": vocab, "embed_dim": width, "param_dtype": m.dtype}
    for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "max_seq_len"):
        value = getattr(abstract, field, None)
        if isinstance(value, int) and value > 0:
            out[field] = value
    for field in ("num_layers", "num_heads", "head_dim", "mlp_dim"):
        out.setdefault(field, 1)  # (not a decoder posttrain knows: sizes only for estimates)
    out.setdefault("num_kv_heads", out["num_heads"])
    return out


def nnx_num_params(spec: NNXSpec) -> int:
    return sum(math.prod(v.get_value().shape) for v in _module(spec).variables)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens_BS", "positions_BS", "segment_ids_BS", "index"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class NNXCache:
    """The tokens of S slots per row written so far, for decoding an NNX module: each pass
    writes its L tokens at `index` and runs the module over all S slots (slots not yet written
    have segment id -1, and sit after every written one, so causal attention never sees them)."""

    tokens_BS: jax.Array
    positions_BS: jax.Array
    segment_ids_BS: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, batch: int, length: int) -> NNXCache:
        zeros = jnp.zeros((batch, length), jnp.int32)
        minus = jnp.full((batch, length), -1, jnp.int32)
        return cls(zeros, zeros, minus, jnp.zeros((), jnp.int32))

    def repeat(self, n: int) -> NNXCache:
        """Each row n times in a row (the n samples of a prompt share its prefill)."""
        rows = lambda a: jnp.repeat(a, n, axis=0)  # noqa: E731
        return NNXCache(rows(self.tokens_BS), rows(self.positions_BS),
                        rows(self.segment_ids_BS), self.index)  # fmt: skip


def nnx_hidden_states(
    spec: NNXSpec,
    params: dict,
    tokens_BL,
    positions_BL,
    segment_ids_BL,
    cache: NNXCache | None = None,
):
    """The module's hidden states `[B, L, D]` (its logits when it gives no hidden states); with
    a cache, `(hidden, cache)` after writing these tokens into it."""
    module = module_of(spec, params)
    run = module.hidden_states if _module(spec).split else module
    if cache is None:
        return run(tokens_BL, positions_BL, segment_ids_BL)
    L = tokens_BL.shape[1]
    write = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=cache.index, axis=1)
    new = NNXCache(
        write(cache.tokens_BS, tokens_BL.astype(jnp.int32)),
        write(cache.positions_BS, positions_BL.astype(jnp.int32)),
        write(cache.segment_ids_BS, segment_ids_BL.astype(jnp.int32)),
        cache.index + L,
    )
    out_BSD = run(new.tokens_BS, new.positions_BS, new.segment_ids_BS)
    return jax.lax.dynamic_slice_in_dim(out_BSD, cache.index, L, axis=1), new


def nnx_logits(spec: NNXSpec, params: dict, hidden_BLD):
    """Float32 vocabulary logits from `nnx_hidden_states`'s output."""
    if not _module(spec).split:
        return hidden_BLD.astype(jnp.float32)
    return module_of(spec, params).logits(hidden_BLD).astype(jnp.float32)
