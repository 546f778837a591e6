"""Versioned datasets: `build` writes sources as an immutable, content-addressed directory of
ArrayRecord shards with a manifest; `diff` says what changed between two. Reading and checking
a build is the input pipeline's (`posttrain.data.verify_build`, `posttrain.data.Records`).

A build directory, `<out_dir>/<build id>/`, holds

    shard-00000.arrayrecord ...  the records in source order, `shard_records` per shard, each the
                                 canonical JSON bytes of one object (sorted keys, no spaces)
    record_hashes.bin            16 bytes per record (the first half of the sha256 of its bytes),
                                 in shard order: what `diff` compares without reading shards
    manifest.json                sources (pattern; per file its sha256 and records), params,
                                 counts, per shard its sha256 and records, the hashes file's
                                 sha256, and the id

The id is the first 16 hex digits of the sha256 of the shards' sha256s and the params; neither
the sources' paths, nor the output path, nor a time enter it, so the same records with the same
params give the same directory, byte for byte. A build is never rewritten: building again from
files with the same bytes finds the build they made (by its manifest) and verifies it, writing
nothing; other files holding the same records are written to a staging folder and find the
directory of their id, which is verified. Training reads a build directory as a data source
(`posttrain.data.Records` opens it): its shards, verified first, and the id goes in
the run's manifest.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from posttrain import paths
from posttrain.data import (
    BUILD_DIGEST,
    BUILD_FORMAT,
    BUILD_HASHES,
    BUILD_MANIFEST,
    Records,
    RecordWriter,
    build_id,
    clear_stale,
    default_mode,
    read_build_manifest,
    read_records,
    record_bytes,
    sha256_file,
    staging_name,
    verify_build,
)


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """What `build` made or found.

    Attributes:
      id: the build id (also the directory's name).
      path: the build directory, `<out_dir>/<id>`.
      reused: True when the directory was already there (and verified), nothing written.
      manifest: the contents of its manifest.json.
    """

    id: str
    path: str
    reused: bool
    manifest: dict[str, Any]


def build(
    sources: str | Iterable[str],
    out_dir: str,
    *,
    shard_records: int = 100_000,
    params: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> BuildResult:
    """Writes the records of `sources` as a build under `out_dir`, or finds it there: a build
    in `out_dir` from files with the same bytes (sha256, in order), params and shard size is
    verified and returned without writing anything.

    Args:
      sources: files or globs (JSON lines, Parquet, ArrayRecord, or another build directory;
        local or gs://), read in the order given, each file by file (sorted) and record by record.
      out_dir: the folder builds live in (local or gs://); this one goes to `<out_dir>/<id>/`.
      shard_records: records per shard (the last shard holds the rest).
      params: JSON values recorded in the manifest and hashed into the id: the filters and
        settings the records went through (a clean or dedup report, a note).
      progress: show a progress bar (on a terminal).

    Returns:
      The `BuildResult`.

    Raises:
      FileNotFoundError: a source is missing or its glob matches nothing.
      ValueError: a record is not a JSON object, or `<out_dir>/<id>` exists but no longer
        matches its manifest (naming the file that differs).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    if not sources:
        raise ValueError("build: give at least one source")
    if shard_records < 1:
        raise ValueError(f"build: shard_records must be positive, got {shard_records}")
    try:
        params = json.loads(record_bytes(dict(params or {})))
    except (TypeError, ValueError) as e:
        raise ValueError(f"build: params must be JSON values ({e})") from None
    local = not paths.is_remote(out_dir)
    if local:
        out_dir = os.fspath(paths.path(out_dir))
        os.makedirs(out_dir, exist_ok=True)
    readers = [Records(pattern) for pattern in sources]  # scanned once, read by both passes
    described = [_describe(p, r) for p, r in zip(sources, readers, strict=True)]
    if found := _built_before(out_dir, described, params, shard_records):
        manifest = verify_build(found)
        return BuildResult(manifest["id"], found, True, manifest)
    if local:
        clear_stale(out_dir, ".build-")  # what a killed build left
    staging = tempfile.mkdtemp(prefix=staging_name(".build-"), dir=out_dir if local else None)
    try:
        manifest = _write(readers, described, staging, shard_records, params, progress)
        return _publish(staging, out_dir, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when renamed into place


def _inputs(described: list[dict], params: dict, shard_records: int) -> list:
    """What decides a build's bytes: its files' sha256s in read order, params, shard size."""
    return [[f["sha256"] for s in described for f in s["files"]], params, shard_records]


def _built_before(out_dir, described, params, shard_records) -> str | None:
    """The directory of a build in `out_dir` made from files with the same bytes, in the same
    order, with the same params and shard size: what building again would write."""
    inputs = _inputs(described, params, shard_records)
    for path in paths.glob(paths.join(out_dir, "*", BUILD_MANIFEST)):
        try:
            m = json.loads(paths.path(path).read_text())
            same = _inputs(m["sources"], m["params"], m["shard_records"]) == inputs
            if same and m["format"] == BUILD_FORMAT:
                return path[: -len(BUILD_MANIFEST) - 1]
        except (ValueError, KeyError, TypeError):
            continue  # not a build's manifest; a build of its id is verified when published
    return None


def _write(readers, described, staging, shard_records, params, progress) -> dict[str, Any]:
    """Writes the shards and the hashes file into `staging`; returns the manifest."""
    from tqdm.auto import tqdm

    total = sum(s["records"] for s in described)
    records = itertools.chain.from_iterable(read_records(r) for r in readers)
    shards = []
    with (
        open(os.path.join(staging, BUILD_HASHES), "wb") as hashes,
        tqdm(total=total, desc="build", unit=" records", disable=None if progress else True) as bar,
    ):
        for index in itertools.count():
            chunk = list(itertools.islice(records, 1))  # the shard's first record, if any
            if not chunk:
                break
            name = f"shard-{index:05d}.arrayrecord"
            rest = itertools.islice(records, shard_records - 1)
            with RecordWriter(os.path.join(staging, name)) as writer:
                for record, where in itertools.chain(chunk, rest):
                    try:
                        data = record_bytes(record)
                    except (TypeError, ValueError) as e:
                        raise ValueError(f"{where}: a value is not JSON ({e})") from None
                    writer.write(record)
                    hashes.write(hashlib.sha256(data).digest()[:BUILD_DIGEST])
                    bar.update()
            path = Path(staging, name)
            shards.append({"file": name, "sha256": sha256_file(path), "records": writer.count})
    return {
        "format": BUILD_FORMAT,
        "id": build_id(params, shards),
        "params": params,
        "shard_records": shard_records,
        "counts": {"records": sum(s["records"] for s in shards), "shards": len(shards)},
        "sources": described,
        "shards": shards,
        "record_hashes": {
            "file": BUILD_HASHES,
            "sha256": sha256_file(Path(staging, BUILD_HASHES)),
            "digest": f"sha256 of each record's canonical JSON, first {BUILD_DIGEST} bytes",
        },
    }


def _describe(pattern: str, records: Records) -> dict[str, Any]:
    """A source in the manifest: its pattern, and each file's name, sha256 and records."""
    if records.build is not None:  # a build of a build: name its shards where they live
        names = [paths.join(pattern, f.path.name) for f in records.files]
    elif paths.is_remote(pattern):  # the files are cached copies; name the objects (as expand)
        names = paths.glob(pattern) if glob.has_magic(pattern) else [pattern]
        names = [n for n in names if paths.path(n).is_file()]
    else:
        names = [os.path.abspath(f.path) for f in records.files]
    files = [
        {"path": name, "sha256": f.sha256, "records": len(f)}
        for name, f in zip(names, records.files, strict=True)
    ]
    return {"pattern": pattern, "records": len(records), "files": files}


def _publish(staging: str, out_dir: str, manifest: dict[str, Any]) -> BuildResult:
    """Moves the staged build to `<out_dir>/<id>`, or verifies the one already there."""
    final = paths.join(out_dir, manifest["id"])
    done = paths.path(paths.join(final, BUILD_MANIFEST)).exists()
    if done:
        existing = verify_build(final)
        if existing["id"] != manifest["id"]:
            raise ValueError(
                f"{final}/{BUILD_MANIFEST}: names build {existing['id']}, not the directory's "
                f"{manifest['id']}; remove {final} and build again"
            )
        return BuildResult(manifest["id"], final, True, existing)
    text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    Path(staging, BUILD_MANIFEST).write_text(text)
    if not paths.is_remote(final):
        if os.path.exists(final):
            raise ValueError(
                f"{final} exists but holds no {BUILD_MANIFEST}; remove it and build again"
            )
        os.chmod(staging, default_mode(folder=True))  # (mkdtemp's folder is private)
        os.replace(staging, final)
    else:  # an earlier upload cut short left no manifest: the same files go up again
        for name in sorted(os.listdir(staging), key=lambda n: n == BUILD_MANIFEST):  # manifest last
            paths.upload(os.path.join(staging, name), paths.join(final, name))
    return BuildResult(manifest["id"], final, False, manifest)


@dataclasses.dataclass(frozen=True)
class RecordChange:
    """A record one build holds and the other does not.

    Attributes:
      hash: hex of its sha256's first `BUILD_DIGEST` bytes, as `record_hashes.bin` holds it.
      index: its index in its build (shard order).
      location: "shard-00001.arrayrecord record 5".
      preview: the start of its text, on one line.
    """

    hash: str
    index: int
    location: str
    preview: str


@dataclasses.dataclass(frozen=True)
class BuildDiff:
    """What changed from build `a` to build `b` (`diff`).

    Attributes:
      a, b: per build: id, path, records, shards.
      sources: source files added, removed or changed (sha256), as {"change", "path", "a",
        "b"} with the sha256 on each side (None where absent); files keyed by path.
      params: params whose value differs, as {"key" (dotted), "a", "b"} (None where absent).
      removed, added: how many records `a` holds that `b` does not, and the reverse (as
        multisets: a record `a` holds twice and `b` once counts once).
      removed_records, added_records: the first `limit` of those, in build order.
    """

    a: dict[str, Any]
    b: dict[str, Any]
    sources: list[dict[str, Any]]
    params: list[dict[str, Any]]
    removed: int
    added: int
    removed_records: list[RecordChange]
    added_records: list[RecordChange]

    @property
    def same(self) -> bool:
        """Whether the two builds hold the same records from the same files with the same
        params (in any order)."""
        return not (self.sources or self.params or self.removed or self.added)


def diff(a: str, b: str, *, limit: int = 20) -> BuildDiff:
    """What changed from build directory `a` to build directory `b`: source files, params,
    counts, and the records removed and added (by content hash, with their locations and a
    preview of the first `limit` of each). Reads both manifests and hashes files (16 bytes per
    record, checked against their manifests) and only the shards holding the previewed records.
    """
    ma, mb = read_build_manifest(a), read_build_manifest(b)
    ha, hb = _hashes(a, ma), _hashes(b, mb)
    removed, added = _unmatched(ha, hb)
    files_a, files_b = _files(ma), _files(mb)
    sources = [
        {"change": change, "path": path, "a": files_a.get(path), "b": files_b.get(path)}
        for path in sorted({*files_a, *files_b})
        if (change := _change(files_a.get(path), files_b.get(path)))
    ]
    flat_a, flat_b = _flat(ma["params"]), _flat(mb["params"])
    params = [
        {"key": k, "a": flat_a.get(k), "b": flat_b.get(k)}
        for k in sorted({*flat_a, *flat_b})
        if flat_a.get(k, ()) != flat_b.get(k, ())
    ]
    readers: dict[str, Records] = {}
    return BuildDiff(
        a=_summary(a, ma),
        b=_summary(b, mb),
        sources=sources,
        params=params,
        removed=len(removed),
        added=len(added),
        removed_records=[_record_change(a, ma, ha, int(i), readers) for i in removed[:limit]],
        added_records=[_record_change(b, mb, hb, int(i), readers) for i in added[:limit]],
    )


def _summary(path: str, manifest: dict[str, Any]) -> dict[str, Any]:
    return {"id": manifest["id"], "path": path, **manifest["counts"]}


def _files(manifest: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["sha256"] for s in manifest["sources"] for f in s["files"]}


def _change(a: str | None, b: str | None) -> str | None:
    if a == b:
        return None
    return "added" if a is None else "removed" if b is None else "changed"


def _flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested params as {"dotted.key": value}."""
    flat = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _hashes(build_dir: str, manifest: dict[str, Any]) -> np.ndarray:
    """The build's record hashes as a [records, 2] uint64 array, checked against the manifest."""
    data = paths.path(paths.join(build_dir, BUILD_HASHES)).read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["record_hashes"]["sha256"]:
        raise ValueError(f"{build_dir}: {BUILD_HASHES} no longer matches {BUILD_MANIFEST}")
    return np.frombuffer(data, dtype=">u8").reshape(-1, BUILD_DIGEST // 8)


def _unmatched(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices into `a` of the hashes `b` lacks, indices into `b` of those `a` lacks), sorted;
    as multisets: a hash `a` holds m times and `b` n < m times leaves `a`'s last m - n.

    Each hash gets its rank among its equal hashes in the same build; (hash, rank) keys are then
    unique per build, so after sorting both builds' keys together a key is matched exactly when
    its neighbour holds the same key.
    """
    keys = np.concatenate([np.column_stack([h, _ranks(h)]) for h in (a, b)])
    side = np.repeat([0, 1], [len(a), len(b)])
    order = np.lexsort((side, *keys.T[::-1]))
    ordered = keys[order]
    same = (ordered[1:] == ordered[:-1]).all(axis=1)
    matched = np.zeros(len(order), bool)
    matched[:-1] |= same
    matched[1:] |= same
    lone = np.sort(order[~matched])
    return lone[lone < len(a)], lone[lone >= len(a)] - len(a)


def _ranks(h: np.ndarray) -> np.ndarray:
    """Per row of `h`, how many equal rows come before it."""
    n = len(h)
    order = np.lexsort((np.arange(n), *h.T[::-1]))
    ordered = h[order]
    new = np.concatenate([[True], (ordered[1:] != ordered[:-1]).any(axis=1)])
    starts = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    ranks = np.empty(n, np.uint64)
    ranks[order] = np.arange(n) - starts
    return ranks


def _record_change(build_dir, manifest, hashes, index, readers) -> RecordChange:
    """Where record `index` of a build is, and a preview of it (its shard read once)."""
    ends = np.cumsum([s["records"] for s in manifest["shards"]])
    shard = int(np.searchsorted(ends, index, side="right"))
    name = manifest["shards"][shard]["file"]
    within = index - (int(ends[shard - 1]) if shard else 0)
    path = paths.join(build_dir, name)
    if path not in readers:
        readers[path] = Records(path)
    raw, _ = readers[path][within]
    return RecordChange(
        hash=hashes[index].tobytes().hex(),
        index=index,
        location=f"{name} record {within}",
        preview=preview(json.loads(raw)),
    )


def preview(record: Mapping[str, Any], width: int = 80) -> str:
    """The start of a record's text on one line: "role: content | ..." for chats, else its
    string fields as "key: value | ..."."""
    if isinstance(record.get("messages"), list):
        parts = [
            f"{m.get('role')}: {m.get('content')}" if isinstance(m, Mapping) else str(m)
            for m in record["messages"]
        ]
    else:
        parts = [f"{k}: {v}" for k, v in sorted(record.items()) if isinstance(v, str)]
    text = " ".join(" | ".join(parts).split()) or record_bytes(record).decode()
    return text if len(text) <= width else text[: width - 3] + "..."
