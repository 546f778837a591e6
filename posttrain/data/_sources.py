"""Record files: JSON lines, Parquet, Arrow and ArrayRecord, read by record index.

`Records(pattern)` turns a file or glob into one random-access sequence of raw records, each with
its location ("data.jsonl line 7"), so that a malformed record can be reported where it lives.
Records are decoded lazily: a JSON-lines file is only scanned once for line offsets (and hashed
in the same pass), and each line is parsed when the pipeline reads it. A Hugging Face dataset
folder (`save_to_disk`, or a dataset repository's layout: `_hf_datasets`) reads as the files of
one split, and a source's column mapping renames its records' fields.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from posttrain import paths
from posttrain.data._build_check import open_build, sha256_file
from posttrain.data._hf_datasets import is_dataset_folder, split_files

FORMATS = ("auto", "messages", "prompt_completion", "text")
_KINDS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".arrayrecord": "arrayrecord",
    ".array_record": "arrayrecord",
}
_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One data source of an SFT mixture.

    Attributes:
      path: a file or a glob of files: .jsonl/.json (JSON lines), .parquet, .arrow (Arrow IPC, as
        `datasets` writes) or .arrayrecord (each record the UTF-8 bytes of one JSON object); a
        `posttrain data build` directory; or a Hugging Face dataset folder (`save_to_disk`'s, or
        a dataset repository's Parquet/Arrow/JSON-lines files with its card).
      weight: relative mixture weight (used when repeating forever, `num_epochs=None`).
      domain: name carried into every example (`domain_ids` in batches, per-domain stats).
      format: "auto" (detected per record from its keys), "messages", "prompt_completion" or
        "text".
      split: the split of a dataset folder ("": its only one; a folder of several names them).
      columns: field names to the record columns that hold them, e.g. {"prompt": "question",
        "answer": "solution"}: each record's column is read as that field (columns not named
        pass through as they are).
    """

    path: str
    weight: float = 1.0
    domain: str = "default"
    format: str = "auto"
    split: str = ""
    columns: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"source {self.path}: format={self.format!r}; use one of {FORMATS}")
        if not self.weight > 0:
            raise ValueError(f"source {self.path}: weight must be positive, got {self.weight}")
        check_columns(self.columns, f"source {self.path}")


def check_columns(columns: Mapping[str, str], where: str) -> None:
    """Raises ValueError unless `columns` maps field names to column names, each column once."""
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in columns.items()):
        raise ValueError(f"{where}: columns maps field names to column names, got {columns!r}")
    taken = sorted(v for v in set(columns.values()) if list(columns.values()).count(v) > 1)
    if taken:
        raise ValueError(f"{where}: columns reads the column {taken[0]!r} into several fields")


def expand(pattern: str) -> list[Path]:
    """The files a path or glob names, sorted; raises FileNotFoundError naming it if none.

    gs:// files are read from cached local copies (`posttrain.paths.local_copy`): records are
    read at random offsets (`pread`), which an object store would answer one request each.
    """
    if paths.is_remote(pattern):
        names = paths.glob(pattern) if glob.has_magic(pattern) else [pattern]
        remote = [n for n in names if paths.path(n).is_file()]
        if not remote:
            what = "glob" if glob.has_magic(pattern) else "file"
            raise FileNotFoundError(f"data source {what} {pattern!r} matches no file")
        return _readable([Path(paths.local_copy(f)) for f in remote])
    if glob.has_magic(pattern):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [p for p in files if p.is_file()]
        if not files:
            raise FileNotFoundError(f"data source glob {pattern!r} matches no file")
    else:
        path = Path(pattern).expanduser()
        if path.is_dir():
            raise FileNotFoundError(
                f"data source {pattern} is a directory; pass a file or a glob such as "
                f"'{pattern.rstrip('/')}/*.jsonl'"
            )
        if not path.is_file():
            raise FileNotFoundError(f"data source {pattern} does not exist")
        files = [path]
    return _readable(files)


def _readable(files: list[Path]) -> list[Path]:
    """`files`, checked to have a suffix this module reads."""
    for p in files:
        if p.suffix.lower() not in _KINDS:
            raise ValueError(
                f"data file {p} has an unsupported suffix; use one of {sorted(_KINDS)}"
            )
    return files


class _JsonLines:
    """A JSON-lines file: byte offsets of its non-blank lines, read back with `pread`."""

    def __init__(self, path: Path):
        self.path = path
        h, newlines, size = hashlib.sha256(), [], 0
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + size)
                size += len(chunk)
        self.sha256 = h.hexdigest()
        ends = np.concatenate([*newlines, [size]]).astype(np.int64)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        keep = ends > starts
        # Lines of one or two bytes may be "\r" or blank; look at those few to leave them out.
        with open(path, "rb") as f:
            for i in np.flatnonzero(keep & (ends - starts <= 2)):
                f.seek(starts[i])
                keep[i] = bool(f.read(ends[i] - starts[i]).strip())
        self._lines = np.flatnonzero(keep) + 1  # 1-based line numbers
        self._starts, self._ends = starts[keep], ends[keep]
        self._fd, self._pid, self._lock = None, None, threading.Lock()

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> tuple[bytes, str]:
        if self._pid != os.getpid():  # opened lazily, and again after a fork
            with self._lock:
                if self._pid != os.getpid():
                    self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        start, end = int(self._starts[i]), int(self._ends[i])
        return os.pread(self._fd, end - start, start), f"{self.path} line {self._lines[i]}"

    def __getstate__(self):
        return {**self.__dict__, "_fd": None, "_pid": None, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def __del__(self):
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            os.close(self._fd)


class _Parquet:
    """A Parquet file, decoded one row group at a time (a few kept in a small cache)."""

    _CACHED_GROUPS = 4

    def __init__(self, path: Path):
        import pyarrow.parquet as pq

        self.path = path
        meta = pq.ParquetFile(path).metadata
        self.column_names = meta.schema.to_arrow_schema().names
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._offsets = np.cumsum([0, *sizes])
        self._file = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, i: int) -> tuple[dict[str, Any], str]:
        import pyarrow.parquet as pq

        group = int(np.searchsorted(self._offsets, i, side="right")) - 1
        with self._lock:
            if (table := self._cache.get(group)) is None:
                self._file = self._file or pq.ParquetFile(self.path)
                table = self._cache[group] = self._file.read_row_group(group)
                if len(self._cache) > self._CACHED_GROUPS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(group)
        row = table.slice(i - int(self._offsets[group]), 1).to_pylist()[0]
        # Columns another record type fills are null here; drop them so formats see absent keys.
        return {k: v for k, v in row.items() if v is not None}, f"{self.path} row {i}"

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_cache": collections.OrderedDict(), "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())


class _Arrow:
    """An Arrow IPC file, stream format (what `datasets` writes) or file format, memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        self._table = None
        self._rows, self.column_names = len(self.table), self.table.column_names

    @property
    def table(self):
        if self._table is None:
            import pyarrow as pa

            source = pa.memory_map(str(self.path))
            try:
                self._table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                try:
                    self._table = pa.ipc.open_file(source).read_all()
                except pa.ArrowInvalid as e:
                    raise ValueError(f"{self.path} is not an Arrow IPC file ({e})") from None
        return self._table

    @property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, i: int) -> tuple[dict[str, Any], str]:
        row = self.table.slice(i, 1).to_pylist()[0]
        return {k: v for k, v in row.items() if v is not None}, f"{self.path} row {i}"

    def __getstate__(self):
        return {**self.__dict__, "_table": None}


class _ArrayRecord:
    """An ArrayRecord file of JSON-encoded records."""

    def __init__(self, path: Path):
        import grain

        self.path = path
        self._source = grain.sources.ArrayRecordDataSource([str(path)])

    @property
    def sha256(self) -> str:
        return sha256_file(self.path)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, i: int) -> tuple[bytes, str]:
        return self._source[i], f"{self.path} record {i}"


_READERS = {
    "jsonl": _JsonLines,
    "parquet": _Parquet,
    "arrow": _Arrow,
    "arrayrecord": _ArrayRecord,
}


class Records:
    """The records of one source's files as a single sequence of (raw record, location).

    A raw record is the bytes of one JSON object (JSON lines, ArrayRecord) or a dict (a Parquet
    or Arrow row, or any record read through a column mapping). Locations name the file and the
    1-based line (JSON lines) or 0-based row/record index.

    A build directory (`posttrain data build`) reads as its shards, after they are checked
    against its manifest; `build` is then {"id", "path"} of it, else None. A Hugging Face dataset
    folder reads as the files of `split` ("": its only split). `columns` ({field: column}) reads
    each named column as that field.

    Raises (at construction):
      FileNotFoundError: the path is missing or the glob matches nothing.
      ValueError: a file has an unknown suffix, the source holds no records at all, a build's
        shard no longer matches its manifest, the split is not the folder's, or the first record
        lacks a column that `columns` names.
    """

    def __init__(self, pattern: str, split: str = "", columns: Mapping[str, str] | None = None):
        self.pattern, self.split, self.columns = pattern, split, dict(columns or {})
        shards, self.build = open_build(pattern)
        local = Path(pattern).expanduser()
        if shards is None and not paths.is_remote(pattern) and is_dataset_folder(local):
            shards, self.split = split_files(local, split)
        elif split:
            raise ValueError(f"data source {pattern}: split={split!r} needs a dataset folder")
        self.files = [_READERS[_KINDS[p.suffix.lower()]](p) for p in shards or expand(pattern)]
        self._offsets = np.cumsum([0, *map(len, self.files)])
        if len(self) == 0:
            names = ", ".join(str(f.path) for f in self.files)
            raise ValueError(f"data source {pattern} holds no records (files: {names})")
        if self.columns:
            self._check_columns()

    @classmethod
    def of(cls, source: SourceConfig) -> Records:
        """The records of a configured source."""
        return cls(source.path, source.split, source.columns)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, i: int) -> tuple[Any, str]:
        f = int(np.searchsorted(self._offsets, i, side="right")) - 1
        raw, where = self.files[f][i - int(self._offsets[f])]
        if not self.columns:
            return raw, where
        if isinstance(raw, bytes | str):
            try:
                raw = json.loads(raw)
            except ValueError:
                return raw, where  # malformed: reported where the record is decoded
        if not isinstance(raw, dict):
            return raw, where
        read = {column: field for field, column in self.columns.items() if column in raw}
        return {**{k: v for k, v in raw.items() if k not in read}, **{
            field: raw[column] for column, field in read.items()}}, where  # fmt: skip

    def _check_columns(self) -> None:
        """Raises ValueError if the first file lacks a column that `columns` names."""
        first = self.files[0]
        have = getattr(first, "column_names", None)
        where = str(first.path)
        if have is None:  # JSON: the first record's keys
            raw, where = first[0]
            try:
                record = json.loads(raw)
            except ValueError:
                return  # malformed: reported where the record is decoded
            if not isinstance(record, dict):
                return
            have = list(record)
        missing = [c for c in self.columns.values() if c not in have]
        if missing:
            raise ValueError(
                f"data source {self.pattern}: columns names {missing}, which {where} does not "
                f"have; its columns are {sorted(have)}"
            )

    def describe(self) -> list[dict[str, Any]]:
        """Per file: path, sha256 of its bytes and number of records (hashes are computed here)."""
        return [{"path": str(f.path), "sha256": f.sha256, "records": len(f)} for f in self.files]


def canonical_identity(identity: dict) -> dict:
    """A pipeline identity as plain JSON values, local source paths made absolute and normal
    (a config file read by the CLI names `configs/../data.jsonl`, by Python `/abs/data.jsonl`)."""
    identity = json.loads(json.dumps(identity))
    for source in identity.get("config", {}).get("sources", []):
        path = source.get("path", "")
        if isinstance(path, str) and "://" not in path:
            source["path"] = os.path.abspath(path)
    return identity
