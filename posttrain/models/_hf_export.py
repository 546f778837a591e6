"""An HF export's safetensors written by every process, none gathering the model.

The layout of every file (which tensors, in which order, at which byte offsets; its header) is a
function of the tensors' names, shapes and the storage dtype, so each process computes it alone
(`plan`). Each HF tensor (one layer of one weight) is converted from ours on the devices with its
rows split over the processes (`jax.jit` with row-sharded outputs: the mesh's collectives move
the data), and each process writes the rows its devices hold: a row block of a row-major tensor
is one byte range of its file. A local file is created whole by process 0 and filled by every
process with `pwrite` (the folder must be shared by all processes, e.g. NFS); on gs:// each
process writes its ranges as part objects and process 0 concatenates them with compose.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from posttrain import paths
from posttrain.models._safetensors import CODES, open_kvstore

_COMPOSE_LIMIT = 32  # GCS composes at most 32 objects per request
_PARTS = ".parts"  # folder of the part objects in a gs:// staging folder
_PENDING_BYTES = 256 * 1024**2  # part writes in flight before waiting for them


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where one HF tensor goes."""

    file: str
    start: int  # byte offset of its data in the file
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    files: dict[str, bytes]  # file name -> its first bytes (header length + header)
    sizes: dict[str, int]  # file name -> size in bytes
    tensors: dict[str, Placed]


def plan(tensors: list[tuple[str, tuple[int, ...]]], dtype: np.dtype, max_bytes: int) -> Layout:
    """The files of an export of `tensors` (in order), a new file begun whenever the next tensor
    would take the current one past `max_bytes`: `model.safetensors` alone, or
    `model-0000i-of-0000n.safetensors`."""
    groups: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tuple(shape), nbytes))
        size += nbytes
    n = len(groups)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    files, sizes, placed = {}, {}, {}
    for file, group in zip(names, groups, strict=True):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, nbytes in group:
            header[name] = {
                "dtype": CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data 8-byte aligned, as safetensors writes it
        files[file] = len(raw).to_bytes(8, "little") + raw
        sizes[file] = len(files[file]) + offset
        for name, shape, nbytes in group:
            start = len(files[file]) + header[name]["data_offsets"][0]
            placed[name] = Placed(file, start, shape, nbytes)
    return Layout(files, sizes, placed)


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class Writer:
    """Writes byte ranges of the files of `layout` into the folder `staging` (local and shared by
    every process, or a gs:// prefix); every process makes one, then calls `close` (or uses it
    as a context manager: closed on success, its files let go of on an error)."""

    def __init__(self, staging: str, layout: Layout):
        self.staging, self.layout = staging, layout
        self.remote = paths.is_remote(staging)
        self._fds: dict[str, int] = {}
        self._pending: list = []
        self._pending_bytes = 0
        if self.remote:
            self._kv = open_kvstore(staging)
        if jax.process_index() == 0:
            for file, head in layout.files.items():
                if self.remote:
                    self._pending.append(self._kv.write(_part(file, 0), head))
                    continue
                with open(os.path.join(staging, file), "wb") as f:
                    f.write(head)
                    f.truncate(layout.sizes[file])
        barrier("posttrain-export-files")  # every local file exists before anyone writes

    def write(self, name: str, row_start: int, data: np.ndarray) -> None:
        """Writes `data`, rows `row_start...` of HF tensor `name` (row-major, storage dtype)."""
        placed = self.layout.tensors[name]
        row_bytes = placed.nbytes // max(placed.shape[0], 1) if placed.shape else placed.nbytes
        offset = placed.start + row_start * row_bytes
        raw = np.ascontiguousarray(data).tobytes()
        if self.remote:
            self._pending.append(self._kv.write(_part(placed.file, offset), raw))
            self._pending_bytes += len(raw)
            if self._pending_bytes > _PENDING_BYTES:
                self._wait()
            return
        if placed.file not in self._fds:
            self._fds[placed.file] = os.open(os.path.join(self.staging, placed.file), os.O_WRONLY)
        os.pwrite(self._fds[placed.file], raw, offset)

    def _wait(self) -> None:
        for future in self._pending:
            future.result()
        self._pending, self._pending_bytes = [], 0

    def _release(self) -> None:
        """Closes this process's open files (a failed write leaves them open otherwise)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self._pending, self._pending_bytes = [], 0
            self._release()

    def close(self) -> None:
        """Finishes this process's writes, waits for every process's, and (gs://) has process 0
        compose each file from its parts."""
        try:
            self._wait()
            for fd in self._fds.values():
                os.fsync(fd)  # a full disk may only tell here
        finally:
            self._release()
        barrier("posttrain-export-written")
        if self.remote and jax.process_index() == 0:
            fs = filesystem(self.staging)
            for file in self.layout.files:
                _compose(fs, self.staging, file, self.layout.sizes[file])
            fs.rm(paths.join(self.staging, _PARTS), recursive=True)


def _split(n: int, procs: int, per: int):
    """How to split a dimension of `n` over the (processes, devices) mesh: over every device,
    else over the processes, else not at all."""
    if n and n % (procs * per) == 0:
        return ("p", "l")
    if n and n % procs == 0:
        return "p"
    return None


def filesystem(url: str):
    """The fsspec filesystem of an object-storage URL (gcsfs for gs://), emulator configured."""
    import fsspec

    paths.path(url)  # points clients at an emulator, if one is set
    return fsspec.core.url_to_fs(url)[0]


def _part(file: str, offset: int) -> str:
    return f"{_PARTS}/{file}/{offset:016d}"  # names sort by offset: the compose order


def _compose(fs, staging: str, file: str, size: int) -> None:
    """Concatenates the parts of `file` (in offset order) into `staging/file`, at most
    `_COMPOSE_LIMIT` objects per request, and checks it has its planned `size`."""
    parts = sorted(fs.ls(paths.join(staging, _PARTS, file), detail=False, refresh=True))
    target = paths.join(staging, file)
    done: list[str] = []
    while parts:
        take = _COMPOSE_LIMIT - len(done)
        fs.merge(target, done + parts[:take])
        done, parts = [target], parts[take:]
    fs.invalidate_cache(target)
    if fs.size(target) != size:
        raise RuntimeError(f"{target} has {fs.size(target)} bytes after compose, not {size}")


def hf_rows(
    convert, param: jax.Array, index: tuple[int, ...], dtype, row_axis: int | None, cache: dict
) -> Iterator[tuple[int, np.ndarray]]:
    """`(row_start, rows)` of the HF tensor `convert(param[index])` that this process writes.

    Its rows are split over the processes (and their devices) when they divide evenly, so the
    conversion's collectives leave each process its own block; a tensor whose rows do not divide
    is converted replicated and written by one process (chosen by `index`, for balance).
    `row_axis`, the axis of `param[index]` that becomes the HF rows' outermost index, is split
    alike first (an all-to-all), so the conversion itself moves nothing (XLA would otherwise
    replicate the layer's tensor on every device to transpose it). `cache` keeps the jitted
    conversions of one export.
    """
    devices = sorted(param.sharding.device_set, key=lambda d: (d.process_index, d.id))
    procs = sorted({d.process_index for d in devices})
    per = len(devices) // len(procs)
    mesh = Mesh(np.array(devices).reshape(len(procs), per), ("p", "l"))
    piece = jax.eval_shape(lambda p: p[index], param).shape
    shape = jax.eval_shape(lambda p: convert(p[index]), param).shape
    rows = shape[0] if shape else 1
    spec = _split(rows if shape else 0, len(procs), per)
    sharding = NamedSharding(mesh, PartitionSpec(spec))
    before = None
    if row_axis is not None:
        axes = [None] * len(piece)
        axes[row_axis] = _split(piece[row_axis], len(procs), per)
        before = NamedSharding(mesh, PartitionSpec(*axes))
    key = (convert, sharding, before)
    if key not in cache:

        def fn(p, i):
            x = p[tuple(i)] if len(i) else p
            if before is not None:
                x = jax.lax.with_sharding_constraint(x, before)
            return convert(x).astype(dtype)

        cache[key] = jax.jit(fn, out_shardings=sharding)
    out = cache[key](param, np.asarray(index, np.int32))
    holders: dict[tuple[int, int], set[int]] = {}
    for device, idx in out.sharding.devices_indices_map(shape).items():
        span = idx[0].indices(rows)[:2] if shape else (0, 1)
        holders.setdefault(span, set()).add(device.process_index)
    mine = {}
    for shard in out.addressable_shards:
        span = shard.index[0].indices(rows)[:2] if shape else (0, 1)
        owners = sorted(holders[span])
        if owners[sum(index) % len(owners)] == jax.process_index() and span not in mine:
            mine[span] = shard.data
    blocks: list[tuple[int, int, list]] = []  # adjacent spans joined: one write, one part
    for (start, stop), data in sorted(mine.items()):
        if blocks and blocks[-1][1] == start:
            blocks[-1] = (blocks[-1][0], stop, [*blocks[-1][2], data])
        else:
            blocks.append((start, stop, [data]))
    for start, _, datas in blocks:
        yield (
            start,
            np.concatenate([np.asarray(d) for d in datas]) if shape else np.asarray(datas[0]),
        )
