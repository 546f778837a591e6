"""Hugging Face interop: read and write `config.json` + safetensors with no torch at runtime.

Tensors are read lazily per file and written straight into each device's shard, so loading onto
a mesh never assembles a full replica of a weight on one device.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from safetensors import safe_open
from safetensors.numpy import save_file

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models._config import ModelConfig
from posttrain.models._hf_config import (
    HFFormatError,
    config_to_hf,
    export_layout,
    hf_model_type,
    load_hf_config_and_layout,
    local_model_dir,
    read_json,
)
from posttrain.models._hf_table import HFTensor, mtp_weight_table, weight_table
from posttrain.models._mtp import MTPModule, mtp_param_shardings, mtp_param_specs
from posttrain.models._params import param_shardings, param_specs
from posttrain.models._transformer import Transformer

log = logging.getLogger(__name__)

# Tensors HF checkpoints may carry that the model recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What makes an export folder load (merged, PEFT): transformers and PEFT read nothing without it.
_CONFIGS = ("config.json", "adapter_config.json")
_INDEX = "model.safetensors.index.json"  # which shard holds each tensor


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
        self._handles: dict[str, object] = {}
        index_path = os.path.join(path, _INDEX)
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
            self.file_of = {name: f for f in files for name in self._handle(f).keys()}

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
        file = self.file_of[name]
        try:
            return self._handle(file).get_tensor(name)
        except Exception as e:  # a file cut short after its header
            raise HFFormatError(
                f"tensor {name!r} in {os.path.join(self.path, file)} is unreadable ({e}); the "
                "file is damaged or incomplete: download or export it again"
            ) from None


def _load_param(entry: HFTensor, files: _SafetensorsDir, shape, dtype, sharding) -> jax.Array:
    """Fills each addressable device's shard from HF tensors, one HF tensor at a time.

    An HF tensor (one layer, or one expert of one layer) is read only if some addressable shard
    holds part of it, and then once for all the shards that do.
    """
    index_map = sharding.addressable_devices_indices_map(shape)
    buffers: dict[tuple, np.ndarray] = {}  # one host buffer per distinct shard
    for index in index_map.values():
        key = _index_key(index, shape)
        if key not in buffers:
            buffers[key] = np.empty([stop - start for start, stop in key], dtype)
    for lead, name in entry.pieces(shape):
        targets = [
            (key, buf)
            for key, buf in buffers.items()
            if all(start <= i < stop for i, (start, stop) in zip(lead, key, strict=False))
        ]
        if not targets:
            continue
        value = entry.to_ours(files.read(name)).astype(dtype)
        for key, buf in targets:
            local = tuple(i - start for i, (start, _) in zip(lead, key, strict=False))
            buf[local] = value[tuple(slice(*k) for k in key[len(lead) :])]
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
    path = local_model_dir(path)
    if dtype is not None:
        overrides["param_dtype"] = jnp.dtype(dtype).name
    config, layout = load_hf_config_and_layout(path, **overrides)
    files = _SafetensorsDir(path)
    table = weight_table(config, layout)
    specs = param_specs(config)
    _check_tensors(files, table, specs, config, layout.extra_layers)  # before reading any
    shardings = None if mesh is None else param_shardings(config, mesh)
    return Transformer(_load_params(files, table, specs, config, shardings), config)


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
    path = local_model_dir(path)
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
    extra_layers: int,
) -> None:
    """Every tensor the table needs is there with its shape, and every other one is accounted
    for: recomputed buffers, a tied lm_head, or (skipped, and logged) multi-token-prediction
    layers after the last."""
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


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(entry: HFTensor, param: jax.Array) -> Iterator[tuple[str, np.ndarray]]:
    """`(HF name, HF tensor)` of each piece of `param`, gathered to the host a layer at a time
    (every process joins each gather)."""
    if not entry.stacked_dims:
        yield entry.name(()), entry.to_hf(_to_host(param))
        return
    for t in range(param.shape[0]):
        layer = _to_host(param[t])
        for rest in itertools.product(*(range(n) for n in param.shape[1 : entry.stacked_dims])):
            yield entry.name((t, *rest)), entry.to_hf(layer[rest])


def to_hf(
    model: Transformer,
    path: str,
    *,
    dtype=None,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
) -> None:
    """Writes `model` as an HF directory (`config.json` + safetensors) that transformers loads.

    Shards are written as they fill, so host memory holds at most one shard (plus one layer of
    one weight). The export is whole: it replaces a previous export at `path` (its weights,
    index and configs; tokenizer files stay), so `path` never loads a mix of the two.

    Args:
      model: the model to export.
      path: output directory (created), local or gs:// (written locally, then uploaded).
      dtype: storage dtype (default: the params' dtype), e.g. "bfloat16".
      max_shard_bytes: larger checkpoints are split into shards with an index file.
      overwrite: export into `path` even if it holds files but no previous export (e.g. a
        training workdir): its config.json and *.safetensors are replaced, other files stay.

    Raises:
      ValueError: the model has no exact HF equivalent (e.g. MoE routing HF cannot express).
      UserError: `path` is not empty and holds no export, and `overwrite` is False.
    """
    config = model.config
    np_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
    hf_config = config_to_hf(config, jnp.dtype(np_dtype).name)  # fails before writing anything
    with staged_export(path, overwrite=overwrite) as staging:
        _write_hf(model, hf_config, staging, np_dtype, max_shard_bytes)


def _write_hf(
    model: Transformer, hf_config: dict, path: str, np_dtype, max_shard_bytes: int
) -> None:
    """Writes the export into the empty local folder `path`: every process joins the gathers,
    process 0 writes."""
    config = model.config
    process_zero = jax.process_index() == 0
    shard: dict[str, np.ndarray] = {}
    written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)

    def flush():
        if shard and process_zero:
            tmp = os.path.join(path, f".shard-{len(written):05d}.tmp")
            save_file(shard, tmp, metadata={"format": "pt"})
            written.append((tmp, list(shard)))
        shard.clear()

    total = 0
    for entry in weight_table(config, export_layout(config)):
        for name, value in _hf_tensors(entry, _get(model.params, entry.path)):
            value = np.ascontiguousarray(value.astype(np_dtype))
            if sum(v.nbytes for v in shard.values()) + value.nbytes > max_shard_bytes:
                flush()
            shard[name] = value
            total += value.nbytes
    flush()
    if not process_zero:
        return
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        file = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, os.path.join(path, file))
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ----------------------------------------------------------------------------- whole exports


def _is_export_file(name: str) -> bool:
    """Whether an export (merged or PEFT) owns `name`. Tokenizer files and
    generation_config.json are not owned: no export writes them (users copy them in beside the
    weights, and posttrain's tokenizer reads its eos ids from generation_config.json)."""
    return name in _CONFIGS or name == _INDEX or name.endswith(".safetensors")


def check_export_destination(path: str, *, overwrite: bool = False) -> None:
    """Raises `UserError` unless an export may go to `path` (what `to_hf` checks first; a
    command calls it before loading a large checkpoint)."""
    _check_destination(paths.path(path), overwrite)


def _check_destination(dest: epath.Path, overwrite: bool) -> None:
    """Refuses a destination that is a file, or a non-empty folder holding no export."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file; export into a directory")
    if overwrite or not dest.exists():
        return
    names = [p.name for p in dest.iterdir()]
    # A previous export is known by its weights, not its config: a kill midway through
    # `_replace_export` leaves weights without config.json, and the rerun must be accepted.
    if names and not any(n == _INDEX or n.endswith(".safetensors") for n in names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(
            f"{dest} is not empty ({shown}) and holds no exported model; pick an empty "
            f"directory (e.g. {dest / 'hf'}) or pass --overwrite (overwrite=True) to export "
            "into it anyway"
        )


@contextlib.contextmanager
def staged_export(path: str, *, overwrite: bool = False) -> Iterator[str]:
    """An empty local folder to write an export into; on success its files replace the export
    at `path` (`_replace_export`), on error it is removed and `path` is left as it was.

    Raises:
      UserError: `path` is not empty and holds no export, and `overwrite` is False.
    """
    dest = paths.path(path)
    _check_destination(dest, overwrite)
    beside = not paths.is_remote(path) and jax.process_index() == 0
    if beside:  # on the destination's filesystem, so files move in by rename
        dest.parent.mkdir(parents=True, exist_ok=True)
    # gs:// (and processes other than 0, which write nothing): any local folder.
    staging = tempfile.mkdtemp(
        prefix=f".{dest.name}.export-", dir=os.fspath(dest.parent) if beside else None
    )
    try:
        yield staging
        if jax.process_index() == 0:
            _replace_export(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace_export(staging: str, dest: epath.Path) -> None:
    """Moves the export in `staging` into `dest` and removes the previous export's files that
    the new one lacks; files no export owns (tokenizer, README) stay.

    The order makes a kill at any point leave `dest` loading the old export whole, the new one
    whole, or failing loudly (no config.json), never a silent mix:
      1. the old configs go first: without them nothing loads the folder;
      2. the old index goes next: it could name a new shard (same file name) beside old ones;
      3. the new weights move in, replacing same-named old ones;
      4. the old weights the new export lacks go (some *.safetensors is in the folder at every
         step, so a rerun after a kill is accepted as a previous export);
      5. the new index, then the new configs last: they make the folder load.
    On gs:// each step is an upload or a delete (objects have no rename), in the same order.
    """
    remote = paths.is_remote(dest)
    dest.mkdir(parents=True, exist_ok=True)
    listed = dest.iterdir() if dest.exists() else ()  # gs:// has no empty folders
    old = {p.name for p in listed if _is_export_file(p.name) and p.is_file()}
    new = set(os.listdir(staging))
    loaders = {_INDEX, *_CONFIGS}
    weights = new - loaders

    def remove(names) -> None:
        for name in sorted(names):
            (dest / name).unlink(missing_ok=True)

    def move_in(name: str) -> None:
        if remote:
            paths.upload(os.path.join(staging, name), dest / name)
        else:
            os.replace(os.path.join(staging, name), dest / name)

    remove(old & set(_CONFIGS))
    remove(old & {_INDEX})
    for name in sorted(weights):
        move_in(name)
    remove(old - new - loaders)
    for name in [_INDEX, *_CONFIGS]:
        if name in new:
            move_in(name)
