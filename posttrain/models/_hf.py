"""Hugging Face interop: read and write `config.json` + safetensors with no torch at runtime.

Reading (local or gs://, `_safetensors`): each process reads only the byte ranges of the HF
tensors that its devices' shards hold, straight into those shards, so loading onto a mesh never
assembles a full replica of a weight on one device or host. Writing (`_hf_export`): each
process writes the rows of each HF tensor that its devices hold.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import paths
from posttrain.models._config import ModelConfig
from posttrain.models._hf_carry import Carry, plan_carry
from posttrain.models._hf_config import config_to_hf, hf_model_type, load_hf_config_and_layout
from posttrain.models._hf_export import Writer, hf_rows, plan
from posttrain.models._hf_format import HFFormatError, read_json
from posttrain.models._hf_layout import CheckpointLayout, export_layout
from posttrain.models._hf_table import HFTensor, mtp_weight_table, weight_table
from posttrain.models._hf_vlm import checkpoint_prefixes
from posttrain.models._mtp import MTPModule, mtp_param_shardings, mtp_param_specs
from posttrain.models._params import param_shardings, param_specs
from posttrain.models._safetensors import (
    STATS,
    FormatError,
    MissingFiles,
    Region,
    Safetensors,
    whole,
)
from posttrain.models._staged_export import (  # noqa: F401 (staged_export: for train/_lora)
    INDEX,
    check_export_destination,
    staged_export,
)
from posttrain.models._transformer import Transformer

log = logging.getLogger(__name__)

# Tensors HF checkpoints may carry that the model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    """The tensors of a model directory (one file, or shards with an index), local or gs://,
    read by byte ranges (`_safetensors.Safetensors`): only the parts asked for."""

    def __init__(self, path: str):
        self.path = path
        index_path = paths.join(path, INDEX)
        if paths.path(index_path).exists():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFFormatError(f"{index_path} has no 'weight_map' object")
            try:
                self._files = self._open(sorted(set(weight_map.values())))
            except MissingFiles as e:
                raise HFFormatError(
                    f"{index_path} lists shard file(s) {e.args[0]} that are missing from {path}; "
                    f"download the complete checkpoint"
                ) from None
            self.file_of = dict(weight_map)
        else:
            files = sorted(
                p.name for p in paths.path(path).iterdir() if p.name.endswith(".safetensors")
            )
            if not files:
                raise HFFormatError(
                    f"{path} holds no *.safetensors file (PyTorch .bin checkpoints "
                    f"are not read: convert them to safetensors first)"
                )
            self._files = self._open(files)
            self.file_of = {name: info.file for name, info in self._files.tensors.items()}

    def _open(self, files: list[str]) -> Safetensors:
        try:
            return Safetensors(self.path, files)
        except FormatError as e:
            file, reason = e.args[0]
            raise HFFormatError(
                f"{paths.join(self.path, file)} is not a readable safetensors file: {reason}"
            ) from None

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        info = self._files.tensors.get(name)
        if name not in self.file_of or info is None or info.file != self.file_of[name]:
            raise HFFormatError(
                f"tensor {name!r} is missing from {self.path} (expected shape "
                f"{shape}); the checkpoint does not match its config.json"
            )
        if info.shape != shape:
            raise HFFormatError(
                f"tensor {name!r} in {paths.join(self.path, info.file)} has shape "
                f"{info.shape}, but config.json implies {shape}"
            )

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files.tensors[name].shape

    def read_whole(self, name: str) -> np.ndarray:
        """Tensor `name` as it is stored."""
        return self.read([whole(name, self.shape(name))])[0]

    def read(self, regions: list[Region]) -> list[np.ndarray]:
        """Each region of an HF tensor, read concurrently."""
        try:
            return self._files.read(regions)
        except FormatError as e:  # a file cut short after its header
            file, reason = e.args[0]
            name = next(r.name for r in regions if self.file_of[r.name] == file)
            raise HFFormatError(
                f"tensor {name!r} in {paths.join(self.path, file)} is unreadable ({reason}); the "
                "file is damaged or incomplete: download or export it again"
            ) from None


def _hf_view(entry: HFTensor, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
    """Where each element of our piece of `shape` sits in its HF tensor, as `(offset, strides)`
    in elements, when `entry.to_ours` only rearranges (reshapes, transposes, slices): it is then
    a view, found by applying it to a zero-filled uint8 stand-in (calloc'd: untouched pages cost
    no memory). None for a conversion that copies or computes (the tensor is read whole)."""
    size = math.prod(entry.hf_shape)
    base = np.zeros(max(size, 1), np.uint8)[:size].reshape(entry.hf_shape)
    view = entry.to_ours(base)
    if (
        not isinstance(view, np.ndarray)
        or view.shape != tuple(shape)
        or not np.may_share_memory(view, base)
        or any(s <= 0 for s, n in zip(view.strides, view.shape, strict=True) if n > 1)
    ):
        return None
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return offset, view.strides


def _region(name: str, view, key: tuple) -> tuple[Region, tuple[int, ...]]:
    """The region of HF tensor `name` that our shard `key` (`(start, stop)` per dim) holds,
    and the transpose that turns it into our axis order."""
    offset, strides = view
    order = sorted(range(len(key)), key=lambda k: -strides[k])
    region = Region(
        name,
        offset + sum(start * s for (start, _), s in zip(key, strides, strict=True)),
        tuple(key[k][1] - key[k][0] for k in order),
        tuple(strides[k] for k in order),
    )
    return region, tuple(np.argsort(order))


def _load_param(entry: HFTensor, files: _SafetensorsDir, shape, dtype, sharding) -> jax.Array:
    """Fills each addressable device's shard with the parts of HF tensors it holds.

    When the HF -> ours conversion is a rearrangement (`_hf_view`), only the byte ranges of each
    distinct shard's part of each HF tensor are read; otherwise an HF tensor is read whole, once
    for all the shards that hold part of it. All reads of a param are issued together.
    """
    index_map = sharding.addressable_devices_indices_map(shape)
    buffers: dict[tuple, np.ndarray] = {}  # one host buffer per distinct shard
    for index in index_map.values():
        key = _index_key(index, shape)
        if key not in buffers:
            buffers[key] = np.empty([stop - start for start, stop in key], dtype)
    lead = entry.stacked_dims
    view = _hf_view(entry, tuple(shape[lead:]))
    wanted = []  # (region, [(shard key, our transpose or None)], lead index)
    for index, name in entry.pieces(shape):
        targets = [
            key
            for key in buffers
            if all(start <= i < stop for i, (start, stop) in zip(index, key, strict=False))
        ]
        if not targets:
            continue
        if view is None:
            wanted.append((whole(name, entry.hf_shape), [(key, None) for key in targets], index))
            continue
        for key in targets:
            region, back = _region(name, view, key[lead:])
            wanted.append((region, [(key, back)], index))
    values = files.read([region for region, _, _ in wanted])
    for (_, targets, index), value in zip(wanted, values, strict=True):
        for key, back in targets:
            local = tuple(i - start for i, (start, _) in zip(index, key, strict=False))
            if back is None:
                part = entry.to_ours(value)[tuple(slice(*k) for k in key[lead:])]
            else:
                part = value.transpose(back)
            buffers[key][local] = part.astype(dtype)
    arrays = [
        jax.device_put(buffers[_index_key(index, shape)], device)
        for device, index in index_map.items()
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _full_index(index, shape):
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


def _index_key(index, shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(_full_index(index, shape), shape, strict=True))


def _model_dir(path) -> str:
    """`path` as a string that names the same directory on every process (local: absolute)."""
    path = os.fspath(paths.path(path))
    if not paths.path(path).is_dir():
        raise HFFormatError(f"model directory {path!r} does not exist")
    return path


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
    path = _model_dir(path)
    if dtype is not None:
        overrides["param_dtype"] = jnp.dtype(dtype).name
    config, layout = load_hf_config_and_layout(path, **overrides)
    files = _SafetensorsDir(path)
    if config.vision is not None:  # which prefix names each part in this checkpoint
        layout = dataclasses.replace(layout, prefixes=checkpoint_prefixes(files.file_of))
    table = weight_table(config, layout)
    specs = param_specs(config)
    _check_tensors(files, table, specs, config, layout)  # before reading any
    shardings = None if mesh is None else param_shardings(config, mesh)
    before = dataclasses.replace(STATS)
    params = _load_params(files, table, specs, config, shardings)
    log.info(
        "%s: this process read %.1f MB of tensor data in %d byte ranges (%s)",
        path,
        (STATS.tensor_bytes - before.tensor_bytes) / 1e6,
        STATS.requests - before.requests,
        "posttrain.models._safetensors.STATS counts them",
    )
    return Transformer(params, config)


def _load_params(files, table, specs, config: ModelConfig, shardings) -> dict:
    """The params `table` fills, each placed with its sharding (None: on the first device)."""
    param_dtype = np.dtype(jnp.dtype(config.param_dtype))
    if shardings is None:
        device = jax.local_devices()[0]
        shardings = jax.tree.map(
            lambda _: jax.sharding.SingleDeviceSharding(device),
            specs,
            is_leaf=lambda x: hasattr(x, "axes"),
        )
    params: dict = {}
    for entry in table:
        spec = _get(specs, entry.path)
        _set(
            params,
            entry.path,
            _load_param(entry, files, spec.shape, param_dtype, _get(shardings, entry.path)),
        )
    return params


def mtp_from_hf(path: str, *, dtype=None, mesh=None, **overrides) -> MTPModule:
    """Loads the multi-token-prediction layer of a DeepSeek-V3-style checkpoint (the layer
    `num_hidden_layers` that `from_hf` leaves out) as an `MTPModule`, a speculative drafter
    for the model `from_hf(path)` loads (`posttrain.sampling.MTP`). Arguments as `from_hf`'s.
    """
    path = _model_dir(path)
    if dtype is not None:
        overrides["param_dtype"] = jnp.dtype(dtype).name
    config, layout = load_hf_config_and_layout(path, **overrides)
    if layout.extra_layers < 1:
        raise HFFormatError(
            f"{path} has no multi-token-prediction layers (its config.json declares "
            f"num_nextn_predict_layers = 0, or the model type has none); speculate with "
            f"prompt lookup or a draft model instead"
        )
    files = _SafetensorsDir(path)
    table = mtp_weight_table(config, layout)
    specs = mtp_param_specs(config)
    for entry in table:
        for _, name in entry.pieces(_get(specs, entry.path).shape):
            files.check(name, entry.hf_shape)
    shardings = None if mesh is None else mtp_param_shardings(config, mesh)
    return MTPModule(_load_params(files, table, specs, config, shardings), config)


def _check_tensors(
    files: _SafetensorsDir,
    table: list[HFTensor],
    specs: dict,
    config: ModelConfig,
    layout: CheckpointLayout,
) -> None:
    """Every tensor the table needs is there with its shape, and every other one is accounted
    for: recomputed buffers, a tied lm_head, a VLM encoder's parts the model does not run, or
    (skipped, and logged) multi-token-prediction layers after the last."""
    extra_layers = layout.extra_layers
    known = set()
    for entry in table:
        for _, name in entry.pieces(_get(specs, entry.path).shape):
            files.check(name, entry.hf_shape)
            known.add(name)
    extra = tuple(f"model.layers.{config.num_layers + k}." for k in range(extra_layers))
    skipped = [n for n in files.file_of if n not in known and n.startswith(extra)]
    unused = sorted(
        n
        for n in files.file_of
        if n not in known
        and not n.startswith(extra)
        and not n.startswith(layout.skipped())
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if unused:
        raise HFFormatError(
            f"{files.path} has tensors this {hf_model_type(config)} config does not use, e.g. "
            f"{unused[:3]}; check that config.json matches the weights"
        )
    if skipped:
        log.info(
            "%s: skipped %d tensors of %d multi-token-prediction layer(s) (not part of the model; "
            "mtp_from_hf loads the first as a speculative drafter)",
            files.path,
            len(skipped),
            extra_layers,
        )


# ----------------------------------------------------------------------------- writing


def to_hf(
    model: Transformer,
    path: str,
    *,
    dtype=None,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    source: str | None = None,
) -> None:
    """Writes `model` as an HF directory (`config.json` + safetensors) that transformers loads.

    Every process writes the rows of each HF tensor its devices hold (`_hf_export`), so no host
    gathers the model; host memory holds at most one layer of one weight. The export is whole:
    it replaces a previous export at `path` (its weights, index and configs; tokenizer files
    stay), so `path` never loads a mix of the two. A VLM export also holds, unchanged, the
    tensors of `source` its model does not run (`_hf_carry`), so it keeps every tensor the model
    was loaded with and transformers finds every weight.

    Args:
      model: the model to export.
      path: output directory (created), local or gs:// (each process uploads its byte ranges as
        parts that are then composed). From several processes, a local `path` must be on a
        filesystem they all share.
      dtype: storage dtype (default: the params' dtype), e.g. "bfloat16".
      max_shard_bytes: larger checkpoints are split into shards with an index file.
      overwrite: export into `path` even if it holds files but no previous export (e.g. a
        training workdir): its config.json and *.safetensors are replaced, other files stay.
      source: a VLM's HF directory it was loaded from (`from_hf`'s path; a run's
        `model.hf_path`), whose encoder tensors the model does not run are copied from it
        unchanged; "" for a VLM not loaded from one (e.g. a preset). Every process must see it.

    Raises:
      ValueError: the model has no exact HF equivalent (e.g. MoE routing HF cannot express),
        or it is a VLM and `source` is None.
      UserError: `path` is not empty and holds no export, and `overwrite` is False; `source`
        is gone or holds another model.
      OSError: the destination refused the export (full disk, read-only); its partial files
        are removed and `path` is left as it was (its message says so; its errno is the cause's).
    """
    config = model.config
    np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
    hf_config = config_to_hf(config, jnp.dtype(np_dtype).name)  # fails before writing anything
    carry = plan_carry(config, hf_config, source, _SafetensorsDir)
    with staged_export(path, overwrite=overwrite, shared=True) as staging:
        _write_hf(model, carry, staging, np_dtype, max_shard_bytes)
    if carry.tensors:
        copied = sum(t.source_name is not None for t in carry.tensors)
        log.info(
            "%s: also wrote %d encoder tensors the model does not run: %d copied unchanged from "
            "%s, %d at LayerNorm's init",
            path,
            len(carry.tensors),
            copied,
            source or "(no source)",
            len(carry.tensors) - copied,
        )


def _write_hf(model: Transformer, carry: Carry, path: str, np_dtype, max_shard_bytes: int) -> None:
    """Writes the export into the empty folder `path` that every process sees: each process its
    rows of each HF tensor (`_hf_export`), process 0 the carried tensors, the configs and the
    index."""
    config = model.config
    pieces = []  # (entry, param, index into its stacked dims, HF name)
    for entry in weight_table(config, export_layout(config)):
        param = _get(model.params, entry.path)
        pieces += [(entry, param, i, name) for i, name in entry.pieces(param.shape)]
    tensors = [(p[3], p[0].hf_shape) for p in pieces] + [(t.name, t.shape) for t in carry.tensors]
    layout = plan(tensors, np_dtype, max_shard_bytes)
    with Writer(path, layout) as writer:
        converters: dict = {}
        row_axes = {}  # per weight: the axis of our piece that indexes the HF rows (None: unknown)
        for entry, param, index, name in pieces:
            if entry.path not in row_axes:
                view = _hf_view(entry, param.shape[entry.stacked_dims :])
                row_axes[entry.path] = None if view is None else int(np.argmax(view[1]))
            row_axis = row_axes[entry.path]
            for start, rows in hf_rows(entry.to_hf, param, index, np_dtype, row_axis, converters):
                if start == 0 and rows.shape[1:] != entry.hf_shape[1:]:
                    raise AssertionError(f"{name}: converted to {rows.shape}, not {entry.hf_shape}")
                writer.write(name, start, rows)
        if jax.process_index() == 0:
            for tensor in carry.tensors:  # one at a time: at most one tensor in host memory
                writer.write(tensor.name, 0, carry.read(tensor, np_dtype))
    if jax.process_index() != 0:
        return
    hf_config = carry.hf_config
    paths.write_text(paths.join(path, "config.json"), json.dumps(hf_config, indent=2))
    if len(layout.files) > 1:
        total = sum(t.nbytes for t in layout.tensors.values())
        weight_map = {name: t.file for name, t in layout.tensors.items()}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        paths.write_text(paths.join(path, INDEX), json.dumps(index, indent=2))
