"""Record streams for the data tools (`posttrain data ...`): read any source `Records` reads
(JSON lines, Parquet, ArrayRecord; a file or a glob; local or gs://) one record at a time, and
write records to a JSON-lines, Parquet or ArrayRecord file that appears whole or not at all.

Nothing here holds a corpus in memory: readers yield one decoded record at a time, writers
flush Parquet row groups of `ROW_GROUP` records and stream the other formats.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from posttrain import paths
from posttrain.data._formats import decode
from posttrain.data._sources import _KINDS, Records

ROW_GROUP = 4096


def read_records(source: str | Records) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, location) for every record of `source` (a file or glob, or its `Records`, which
    a second pass can reuse instead of scanning the files again), in file then record order. A
    line that is not a JSON object raises ValueError naming its location."""
    records = source if isinstance(source, Records) else Records(source)
    for i in range(len(records)):
        raw, where = records[i]
        try:
            record = decode(raw)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: not a JSON object ({e})") from None
        if not isinstance(record, Mapping):
            kind = type(record).__name__
            raise ValueError(f"{where}: a record must be a JSON object, got {kind}")
        yield dict(record), where


def kind_of(path: str) -> str:
    """The format of `path` by suffix: "jsonl", "parquet" or "arrayrecord"; else ValueError."""
    suffix = Path(path).suffix.lower()
    if suffix not in _KINDS:
        raise ValueError(f"{path}: unsupported suffix {suffix!r}; use one of {sorted(_KINDS)}")
    return _KINDS[suffix]


def staging_name(stem: str) -> str:
    """The start of a staging file's or folder's name for this process: `<stem><pid>.`, so that
    `clear_stale` tells a killed run's leftovers from a running one's."""
    return f"{stem}{os.getpid()}."


def clear_stale(folder: str, stem: str, suffix: str = "") -> list[str]:
    """Removes what killed runs left in `folder` while staging: the entries named
    `<stem><pid>.<random><suffix>` (`staging_name` + mkstemp/mkdtemp) whose process is gone.
    Returns their names."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        rest = name[len(stem) :] if name.startswith(stem) and name.endswith(suffix) else ""
        parts = rest[: len(rest) - len(suffix)].split(".")  # [pid, random]: no other output's
        if len(parts) != 2 or not parts[0].isdigit() or paths.pid_alive(int(parts[0])):
            continue
        full = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):  # (another run cleared it first)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
            removed.append(name)
    return removed


def default_mode(folder: bool = False) -> int:
    """The permissions a new file (or folder) gets under the process's umask, as `open` gives
    them; `mkstemp` and `mkdtemp` make theirs private, which a published output must not be."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


class RecordWriter:
    """Writes records (JSON-able dicts) to `path`, its format by suffix. The records go to a
    temporary local file that replaces (or uploads to) `path` on `close()`; an exception inside
    `with RecordWriter(...)` discards it, so a crash never leaves a partial output.

    JSON lines are written with sorted keys and no spaces, ArrayRecord records as the same JSON
    bytes (one group per record: readable in any order), Parquet in row groups of `ROW_GROUP`.
    The same records in the same order give byte-identical files."""

    def __init__(self, path: str):
        self.path, self.kind, self.count = path, kind_of(path), 0
        folder = None if paths.is_remote(path) else os.path.dirname(os.path.abspath(path))
        stem = f".{Path(path).name}."
        if folder:
            os.makedirs(folder, exist_ok=True)
            clear_stale(folder, stem, ".part")  # a killed run's staging file of this output
        fd, self._tmp = tempfile.mkstemp(prefix=staging_name(stem), suffix=".part", dir=folder)
        os.close(fd)
        self._rows: list[dict] = []
        self._parquet = None
        self._file = None
        if self.kind == "jsonl":
            self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in close/abort)
        elif self.kind == "arrayrecord":
            from array_record.python.array_record_module import ArrayRecordWriter

            self._file = ArrayRecordWriter(self._tmp, "group_size:1")

    def write(self, record: Mapping[str, Any]) -> None:
        self.count += 1
        if self.kind == "parquet":
            self._rows.append(dict(record))
            if len(self._rows) >= ROW_GROUP:
                self._flush_parquet()
            return
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        self._file.write(line.encode() + b"\n" if self.kind == "jsonl" else line.encode())

    def _flush_parquet(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._parquet is None:  # the columns: every field of the first group's records
            keys = list(dict.fromkeys(k for r in self._rows for k in r))
            table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in self._rows])
            self._parquet = pq.ParquetWriter(self._tmp, table.schema)
        else:
            names = set(self._parquet.schema.names)
            if extra := sorted({k for r in self._rows for k in r} - names):
                raise ValueError(
                    f"{self.path}: records after the first {ROW_GROUP} add fields {extra}; a "
                    "Parquet file has one schema: write .jsonl or .arrayrecord instead"
                )
            table = pa.Table.from_pylist(self._rows, schema=self._parquet.schema)
        self._parquet.write_table(table)
        self._rows = []

    def close(self) -> None:
        """Finishes the file and puts it at `path` (on an error, `abort`s and re-raises)."""
        try:
            if self.kind == "parquet":
                if self._rows or self._parquet is None:
                    self._flush_parquet()
                self._parquet.close()
            else:
                self._file.close()
        except BaseException:
            self.abort()
            raise
        if paths.is_remote(self.path):
            paths.upload(self._tmp, self.path)
            os.remove(self._tmp)
        else:
            os.chmod(self._tmp, default_mode())
            os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drops the temporary file; `path` is left as it was."""
        for handle in (self._file, self._parquet):
            if handle is not None:
                with contextlib.suppress(Exception):  # a half-written file, deleted next
                    handle.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
