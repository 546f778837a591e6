"""Hugging Face interop: read and write `config.json` + safetensors with no torch at runtime.

Tensors are read lazily per file and written straight into each device's shard, so loading onto
a mesh never assembles a full replica of a weight on one device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from posttrain.models._config import ModelConfig
from posttrain.models._hf_config import (
    HFFormatError,
    config_to_hf,
    hf_model_type,
    load_hf_config,
    read_json,
)
from posttrain.models._transformer import Transformer, param_shardings, param_specs

# Tensors HF checkpoints may carry that the model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- weight table


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How one of our params maps to HF tensors (one per layer when `per_layer`)."""

    path: tuple[str, ...]
    hf_name: str  # "{i}" stands for the layer index
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name


def _weight_table(config: ModelConfig) -> list[_Tensor]:
    D, N, K, H, F, V = (
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.mlp_dim,
        config.vocab_size,
    )
    same = lambda w: w
    t = lambda w: w.T
    layer = "model.layers.{i}."

    def proj_in(n):  # HF [n*H, D] <-> ours [D, n, H]
        return (
            lambda w: w.reshape(n, H, D).transpose(2, 0, 1),
            lambda w: w.transpose(1, 2, 0).reshape(n * H, D),
        )

    def bias(n):  # HF [n*H] <-> ours [n, H]
        return (lambda w: w.reshape(n, H), lambda w: w.reshape(n * H))

    table = [
        _Tensor(("embed",), "model.embed_tokens.weight", (V, D), same, same),
        _Tensor(("final_norm",), "model.norm.weight", (D,), same, same),
        _Tensor(("layers", "attn_norm"), layer + "input_layernorm.weight", (D,), same, same),
        _Tensor(
            ("layers", "mlp_norm"), layer + "post_attention_layernorm.weight", (D,), same, same
        ),
        _Tensor(
            ("layers", "attn", "q"), layer + "self_attn.q_proj.weight", (N * H, D), *proj_in(N)
        ),
        _Tensor(
            ("layers", "attn", "k"), layer + "self_attn.k_proj.weight", (K * H, D), *proj_in(K)
        ),
        _Tensor(
            ("layers", "attn", "v"), layer + "self_attn.v_proj.weight", (K * H, D), *proj_in(K)
        ),
        _Tensor(
            ("layers", "attn", "o"),
            layer + "self_attn.o_proj.weight",
            (D, N * H),
            lambda w: w.reshape(D, N, H).transpose(1, 2, 0),
            lambda w: w.transpose(2, 0, 1).reshape(D, N * H),
        ),
        _Tensor(("layers", "mlp", "gate"), layer + "mlp.gate_proj.weight", (F, D), t, t),
        _Tensor(("layers", "mlp", "up"), layer + "mlp.up_proj.weight", (F, D), t, t),
        _Tensor(("layers", "mlp", "down"), layer + "mlp.down_proj.weight", (D, F), t, t),
    ]
    if config.qkv_bias:
        table += [
            _Tensor(
                ("layers", "attn", "q_bias"), layer + "self_attn.q_proj.bias", (N * H,), *bias(N)
            ),
            _Tensor(
                ("layers", "attn", "k_bias"), layer + "self_attn.k_proj.bias", (K * H,), *bias(K)
            ),
            _Tensor(
                ("layers", "attn", "v_bias"), layer + "self_attn.v_proj.bias", (K * H,), *bias(K)
            ),
        ]
    if config.o_bias:
        table.append(
            _Tensor(("layers", "attn", "o_bias"), layer + "self_attn.o_proj.bias", (D,), same, same)
        )
    if config.qk_norm:
        table += [
            _Tensor(
                ("layers", "attn", "q_norm"), layer + "self_attn.q_norm.weight", (H,), same, same
            ),
            _Tensor(
                ("layers", "attn", "k_norm"), layer + "self_attn.k_norm.weight", (H,), same, same
            ),
        ]
    if not config.tie_embeddings:
        table.append(_Tensor(("lm_head",), "lm_head.weight", (V, D), t, t))
    return table


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# ----------------------------------------------------------------------------- reading


class _SafetensorsDir:
    """Lazy access to the tensors of a model directory (one file, or shards with an index)."""

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFFormatError(f"{index_path} has no 'weight_map' object")
            missing = sorted(
                {f for f in weight_map.values() if not os.path.exists(os.path.join(path, f))}
            )
            if missing:
                raise HFFormatError(
                    f"{index_path} lists shard file(s) {missing} that are missing from {path}; "
                    f"download the complete checkpoint"
                )
            self.file_of = dict(weight_map)
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise HFFormatError(
                    f"{path} holds no *.safetensors file (PyTorch .bin checkpoints "
                    f"are not read: convert them to safetensors first)"
                )
            self.file_of = {}
            for f in files:
                with safe_open(os.path.join(path, f), framework="numpy") as handle:
                    for name in handle.keys():
                        self.file_of[name] = f
        self._handles: dict[str, object] = {}

    def _handle(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(os.path.join(self.path, file), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise HFFormatError(
                    f"{os.path.join(self.path, file)} is not a readable safetensors file: {e}"
                ) from None
        return self._handles[file]

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.file_of:
            raise HFFormatError(
                f"tensor {name!r} is missing from {self.path} (expected shape "
                f"{shape}); the checkpoint does not match its config.json"
            )
        file = self.file_of[name]
        actual = tuple(self._handle(file).get_slice(name).get_shape())
        if actual != shape:
            raise HFFormatError(
                f"tensor {name!r} in {os.path.join(self.path, file)} has shape "
                f"{actual}, but config.json implies {shape}"
            )

    def read(self, name: str) -> np.ndarray:
        return self._handle(self.file_of[name]).get_tensor(name)


def _load_param(entry: _Tensor, files: _SafetensorsDir, shape, dtype, sharding) -> jax.Array:
    """Fills each addressable device's shard from HF tensors, one layer tensor at a time."""
    index_map = sharding.addressable_devices_indices_map(shape)
    buffers: dict[tuple, np.ndarray] = {}  # one host buffer per distinct shard
    for index in index_map.values():
        key = _index_key(index, shape)
        if key not in buffers:
            buffers[key] = np.empty(
                [
                    len(range(*s.indices(n)))
                    for s, n in zip(_full_index(index, shape), shape, strict=True)
                ],
                dtype,
            )
    if entry.per_layer:
        for layer in range(shape[0]):
            value = entry.to_ours(files.read(entry.hf_name.format(i=layer))).astype(dtype)
            for key, buf in buffers.items():
                t_slice = slice(*key[0])
                if t_slice.start <= layer < t_slice.stop:
                    buf[layer - t_slice.start] = value[tuple(slice(*k) for k in key[1:])]
    else:
        value = entry.to_ours(files.read(entry.hf_name)).astype(dtype)
        for key, buf in buffers.items():
            buf[...] = value[tuple(slice(*k) for k in key)]
    arrays = [
        jax.device_put(buffers[_index_key(index, shape)], device)
        for device, index in index_map.items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _full_index(index, shape):
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(_full_index(index, shape), shape, strict=True))


def from_hf(path: str, *, dtype=None, mesh=None, **overrides) -> Transformer:
    """Loads an HF checkpoint directory (`config.json` + safetensors) as a `Transformer`.

    Args:
      path: directory with `config.json` and `model.safetensors` or sharded
        `model-*.safetensors` with `model.safetensors.index.json`.
      dtype: parameter dtype (default float32, whatever the checkpoint stores).
      mesh: if given, each parameter is placed with its sharding under the active logical-axis
        rules, each device receiving only its own shard.
      **overrides: ModelConfig fields to change, e.g. `compute_dtype="bfloat16"`,
        `attention="xla"`, `remat="full"`.

    Returns:
      The model; `model.config.name` is the directory name.
    """
    path = os.fspath(path)
    if dtype is not None:
        overrides["param_dtype"] = jnp.dtype(dtype).name
    config = load_hf_config(path, **overrides)
    files = _SafetensorsDir(path)
    table = _weight_table(config)
    for entry in table:  # validate everything before reading anything
        names = (
            [entry.hf_name.format(i=i) for i in range(config.num_layers)]
            if entry.per_layer
            else [entry.hf_name]
        )
        for name in names:
            files.check(name, entry.hf_shape)
    known = {e.hf_name.format(i=i) for e in table for i in range(config.num_layers)}
    unused = sorted(
        n
        for n in files.file_of
        if n not in known
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if unused:
        raise HFFormatError(
            f"{path} has tensors this {hf_model_type(config)} config does not use, e.g. "
            f"{unused[:3]}; check that config.json matches the weights"
        )

    specs = param_specs(config)
    param_dtype = np.dtype(jnp.dtype(config.param_dtype))
    if mesh is None:
        device = jax.local_devices()[0]
        shardings = jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(device),
            specs,
            is_leaf=lambda x: hasattr(x, "axes"),
        )
    else:
        shardings = param_shardings(config, mesh)
    params: dict = {}
    for entry in table:
        spec = _get(specs, entry.path)
        _set(
            params,
            entry.path,
            _load_param(entry, files, spec.shape, param_dtype, _get(shardings, entry.path)),
        )
    return Transformer(params, config)


# ----------------------------------------------------------------------------- writing


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def to_hf(model: Transformer, path: str, *, dtype=None, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Writes `model` as an HF directory (`config.json` + safetensors) that transformers loads.

    Shards are written as they fill, so host memory holds at most one shard (plus one weight).

    Args:
      model: the model to export.
      path: output directory (created).
      dtype: storage dtype (default: the params' dtype), e.g. "bfloat16".
      max_shard_bytes: larger checkpoints are split into shards with an index file.
    """
    config = model.config
    np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
    process_zero = jax.process_index() == 0
    if process_zero:
        os.makedirs(path, exist_ok=True)
    shard: dict[str, np.ndarray] = {}
    written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)

    def flush():
        if shard and process_zero:
            tmp = os.path.join(path, f".shard-{len(written):05d}.tmp")
            save_file(shard, tmp, metadata={"format": "pt"})
            written.append((tmp, list(shard)))
        shard.clear()

    total = 0
    for entry in _weight_table(config):
        value = _to_host(_get(model.params, entry.path))  # every process joins the gather
        layers = range(config.num_layers) if entry.per_layer else [None]
        for i in layers:
            hf_value = entry.to_hf(value if i is None else value[i])
            hf_value = np.ascontiguousarray(hf_value.astype(np_dtype))
            if sum(v.nbytes for v in shard.values()) + hf_value.nbytes > max_shard_bytes:
                flush()
            shard[entry.hf_name.format(i=i)] = hf_value
            total += hf_value.nbytes
    flush()
    if not process_zero:
        return
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, jnp.dtype(np_dtype).name), f, indent=2)
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        file = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, os.path.join(path, file))
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
