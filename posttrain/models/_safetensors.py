"""Safetensors files read by byte ranges through tensorstore's kvstore, local or in object storage.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, `data_offsets` into the data that follows) and the row-major tensor data. `Safetensors`
reads every file's header (a few byte ranges per file) and then only the parts of tensors that
are asked for: a region of a tensor (a strided view of its elements, e.g. one device's shard)
is a set of contiguous runs; the runs of all regions asked for together are sorted, merged when
adjacent, joined across small gaps only while that adds at most `GAP_SLACK` of the bytes, and
read concurrently (tensorstore futures).

`STATS` counts, per process, what was requested from storage; `from_hf` users and tests read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os

import ml_dtypes
import numpy as np
import tensorstore as ts

from posttrain import paths

# Safetensors dtype codes (little-endian numpy dtypes).
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
GAP_SLACK = 0.05  # runs are joined across gaps while the gaps add at most this share of bytes
_MAX_HEADER = 100 * 1024**2  # safetensors' own limit


@dataclasses.dataclass
class ReadStats:
    """What this process requested from storage since the last `reset`."""

    tensor_bytes: int = 0  # bytes of tensor data requested (gaps joined between runs included)
    header_bytes: int = 0  # bytes of file headers (length prefixes, JSON, end checks)
    requests: int = 0  # byte-range reads issued

    def reset(self) -> None:
        self.tensor_bytes = self.header_bytes = self.requests = 0


STATS = ReadStats()


class FormatError(Exception):
    """A file is not a readable safetensors file (the message says why)."""


class MissingFiles(Exception):
    """Some files asked for do not exist (`args[0]`: their names)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # byte offset of the tensor's data in its file


@dataclasses.dataclass(frozen=True)
class Region:
    """Elements `offset + sum(i_k * strides[k])`, `0 <= i_k < lens[k]`, of tensor `name`, with
    `strides` (in elements) non-increasing and the elements distinct; read as a `lens` array."""

    name: str
    offset: int
    lens: tuple[int, ...]
    strides: tuple[int, ...]


def whole(name: str, shape: tuple[int, ...]) -> Region:
    """The region of a whole tensor of `shape`."""
    strides = tuple(math.prod(shape[k + 1 :]) for k in range(len(shape)))
    return Region(name, 0, tuple(shape), strides)


def open_kvstore(directory: str) -> ts.KvStore:
    """A kvstore whose keys are the file names in `directory` (local or gs://)."""
    directory = os.fspath(paths.path(directory))  # configures an emulator, if any
    if not paths.is_remote(directory):
        return ts.KvStore.open({"driver": "file", "path": directory.rstrip("/") + "/"}).result()
    scheme, rest = directory.split("://", 1)
    if scheme != "gs":
        raise ValueError(f"{directory}: only local paths and gs:// are read")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    return ts.KvStore.open(
        {"driver": "gcs", "bucket": bucket, "path": prefix + "/" if prefix else ""}
    ).result()


def _read(kv: ts.KvStore, key: str, start: int, stop: int) -> ts.Future:
    STATS.requests += 1
    return kv.read(key, byte_range=slice(start, stop))


def _value(future, key: str, start: int, stop: int) -> bytes:
    """The bytes a read returned, all `stop - start` of them (else `FormatError`)."""
    try:
        result = future.result()
    except ValueError as e:  # tensorstore: OUT_OF_RANGE past the end of the file
        raise FormatError(f"bytes [{start}, {stop}) are past its end ({e})") from None
    if result.state == "missing":
        raise MissingFiles([key])
    if len(result.value) != stop - start:
        raise FormatError(f"bytes [{start}, {stop}) are past its end (file cut short)")
    return result.value


def _parse_header(raw: bytes, data_start: int) -> dict[str, TensorInfo]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError("its header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"its header entry for {name!r} is malformed: {entry}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            raise FormatError(f"{name!r} has data_offsets {[begin, end]} for shape {shape}")
        tensors[name] = TensorInfo("", dtype, shape, data_start + begin)
    return tensors


class Safetensors:
    """The headers of some safetensors files in one directory, and reads of tensor regions."""

    def __init__(self, directory: str, files: list[str]):
        """Reads every file's header concurrently.

        Raises:
          MissingFiles: some of `files` do not exist.
          FormatError: a file's header is malformed, or the file is shorter than it says
            (`args[0]` is `(file, reason)`).
        """
        self.directory = directory
        self.kv = open_kvstore(directory)
        self.tensors: dict[str, TensorInfo] = {}
        lengths = {f: _read(self.kv, f, 0, 8) for f in files}
        missing = [f for f, fut in lengths.items() if _state(fut) == "missing"]
        if missing:
            raise MissingFiles(sorted(missing))
        headers = {}
        for f, fut in lengths.items():
            with _about(f):
                n = int.from_bytes(_value(fut, f, 0, 8), "little")
            if not 0 < n <= _MAX_HEADER:
                raise FormatError((f, f"its header length {n} is not plausible"))
            headers[f] = (n, _read(self.kv, f, 8, 8 + n))
        ends = {}
        for f, (n, fut) in headers.items():
            STATS.header_bytes += 8 + n
            with _about(f):
                tensors = _parse_header(_value(fut, f, 8, 8 + n), 8 + n)
            for name, info in tensors.items():
                self.tensors[name] = dataclasses.replace(info, file=f)
            end = max(
                (t.start + t.dtype.itemsize * math.prod(t.shape) for t in tensors.values()),
                default=0,
            )
            if end > 8 + n:  # the file must hold the data its header promises
                ends[f] = (end, _read(self.kv, f, end - 1, end))
        for f, (end, fut) in ends.items():
            STATS.header_bytes += 1
            with _about(f):
                _value(fut, f, end - 1, end)

    def read(self, regions: list[Region]) -> list[np.ndarray]:
        """Each region's elements as a `region.lens` array, read with concurrent byte ranges.

        Raises:
          FormatError: a read came back short (`args[0]` is `(file, reason)`).
        """
        runs: dict[str, list[tuple[np.ndarray, int]]] = {}  # file -> (run byte starts, length)
        per_region = []
        for region in regions:
            info = self.tensors[region.name]
            if not math.prod(region.lens):
                per_region.append(None)
                continue
            starts, run = _runs(region)
            size = info.dtype.itemsize
            byte_starts = info.start + starts * size
            runs.setdefault(info.file, []).append((byte_starts, run * size))
            per_region.append((info.file, byte_starts, run * size))
        blobs = {}
        pending = []
        for file, file_runs in runs.items():
            merged = _merge(file_runs)
            STATS.tensor_bytes += int((merged[:, 1] - merged[:, 0]).sum())
            futures = [_read(self.kv, file, int(a), int(b)) for a, b in merged]
            pending.append((file, merged, futures))
        for file, merged, futures in pending:
            with _about(file):
                parts = [
                    _value(fut, file, int(a), int(b))
                    for fut, (a, b) in zip(futures, merged, strict=True)
                ]
            offsets = np.concatenate([[0], np.cumsum(merged[:, 1] - merged[:, 0])])
            blobs[file] = (np.frombuffer(b"".join(parts), np.uint8), merged[:, 0], offsets)
        out = []
        for region, planned in zip(regions, per_region, strict=True):
            dtype = self.tensors[region.name].dtype
            if planned is None:  # no elements
                out.append(np.empty(region.lens, dtype))
                continue
            file, byte_starts, run_bytes = planned
            blob, merged_starts, offsets = blobs[file]
            which = np.searchsorted(merged_starts, byte_starts, side="right") - 1
            positions = offsets[which] + (byte_starts - merged_starts[which])
            data = _gather(blob, positions, run_bytes)
            out.append(data.view(dtype).reshape(region.lens))
        return out


def _state(future) -> str:
    try:
        return future.result().state
    except ValueError:  # shorter than the range: `_value` says so
        return "short"


@contextlib.contextmanager
def _about(file: str):
    """Tags a `FormatError` raised inside with `file`."""
    try:
        yield
    except FormatError as e:
        raise FormatError((file, e.args[0])) from None


def _runs(region: Region) -> tuple[np.ndarray, int]:
    """The start (in elements) of each contiguous run of `region`, in order, and the run length.

    Inner axes whose stride equals the run so far join the run; the outer axes enumerate runs.
    """
    run, k = 1, len(region.lens)
    while k > 0 and (region.lens[k - 1] == 1 or region.strides[k - 1] == run):
        run *= region.lens[k - 1]
        k -= 1
    starts = np.full((), region.offset, np.int64)
    for n, stride in zip(region.lens[:k], region.strides[:k], strict=True):
        starts = starts[..., None] + np.arange(n, dtype=np.int64) * stride
    return starts.reshape(-1), run


def _merge(file_runs: list[tuple[np.ndarray, int]]) -> np.ndarray:
    """`[[start, stop), ...]` byte ranges covering the runs: overlapping and adjacent runs merged,
    then the smallest gaps joined while they add at most `GAP_SLACK` of the bytes."""
    starts = np.concatenate([s for s, _ in file_runs])
    stops = np.concatenate([s + n for s, n in file_runs])
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    gaps = starts[1:] - stops[:-1]  # <= 0: overlapping or adjacent
    join = gaps <= 0
    data = int((stops - starts).sum())  # an upper bound on the bytes wanted: a fine budget
    positive = np.flatnonzero(~join)
    budget = GAP_SLACK * data
    by_size = positive[np.argsort(gaps[positive], kind="stable")]
    taken = by_size[np.cumsum(gaps[by_size]) <= budget]
    join[taken] = True
    first = np.concatenate([[True], ~join])  # a range begins at every gap not joined
    begin = np.flatnonzero(first)
    end = np.concatenate([begin[1:], [len(starts)]]) - 1
    return np.stack([starts[begin], stops[end]], axis=1)


def _gather(blob: np.ndarray, positions: np.ndarray, run_bytes: int) -> np.ndarray:
    """The runs `blob[p : p + run_bytes]` for `p` in `positions`, concatenated."""
    if len(positions) == 1:
        p = int(positions[0])
        return blob[p : p + run_bytes].copy()
    out = np.empty((len(positions), run_bytes), np.uint8)
    chunk = max(1, (1 << 22) // max(run_bytes, 1))  # bounds the index array at ~32 MiB
    inner = np.arange(run_bytes, dtype=np.int64)
    for i in range(0, len(positions), chunk):
        out[i : i + chunk] = blob[positions[i : i + chunk, None] + inner]
    return out.reshape(-1)
