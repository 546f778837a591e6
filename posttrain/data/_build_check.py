"""Reading a data build (`_build.py`) back: its manifest, its verification against the
manifest, and its shards as a source for `Records`. Apart from `_build` so that `_sources` can
read builds without importing the writer (which reads records through `_sources`)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain import paths

FORMAT = "posttrain.data.build/1"
MANIFEST = "manifest.json"
HASHES = "record_hashes.bin"
DIGEST = 16  # bytes kept of each record's sha256
_CHUNK = 1 << 24


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 16 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def record_bytes(record: Any) -> bytes:
    """The canonical JSON bytes of `record`: what `RecordWriter` stores in a shard."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def build_id(params: Mapping[str, Any], shards: list[dict[str, Any]]) -> str:
    """The id of a build: a hash of its params and its shards' sha256s, in order."""
    key = {"format": FORMAT, "params": params, "shards": [s["sha256"] for s in shards]}
    return hashlib.sha256(record_bytes(key)).hexdigest()[:16]


def read_manifest(build_dir: str) -> dict[str, Any]:
    """The manifest.json of a build directory (local or gs://).

    Raises:
      FileNotFoundError: `build_dir` holds no manifest.json.
      ValueError: it is not a build manifest this version reads.
    """
    path = paths.path(paths.join(build_dir, MANIFEST))
    if not path.exists():
        raise FileNotFoundError(f"{build_dir} is not a data build (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{build_dir}/{MANIFEST}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{build_dir}/{MANIFEST}: not a {FORMAT} manifest")
    return manifest


def verify(build_dir: str) -> dict[str, Any]:
    """Checks a build against its manifest: every shard's and the hashes file's sha256, the
    record counts, and the id (so an edited manifest is caught too). Reads every shard once;
    a gs:// build is checked in its cached local copy (`paths.local_copy`).

    Returns:
      The manifest.

    Raises:
      FileNotFoundError: not a build directory.
      ValueError: what no longer matches, naming the file.
    """
    manifest = read_manifest(build_dir)
    local = paths.local_copy(build_dir)
    for entry in [*manifest["shards"], manifest["record_hashes"]]:
        path = Path(local, entry["file"])
        if not path.is_file():
            raise ValueError(f"{build_dir}: {entry['file']} is missing (listed in {MANIFEST})")
        if (got := sha256_file(path)) != entry["sha256"]:
            raise ValueError(
                f"{build_dir}: {entry['file']} no longer matches {MANIFEST} (sha256 {got[:12]}..., "
                f"recorded {entry['sha256'][:12]}...): the build changed after it was written; "
                "build it again from its sources"
            )
    records = sum(s["records"] for s in manifest["shards"])
    size = os.path.getsize(Path(local, HASHES))
    if records != manifest["counts"]["records"] or size != DIGEST * records:
        raise ValueError(f"{build_dir}/{MANIFEST}: its record counts do not add up")
    if (expected := build_id(manifest["params"], manifest["shards"])) != manifest["id"]:
        raise ValueError(
            f"{build_dir}/{MANIFEST}: was edited: its id {manifest['id']} is not the hash of its "
            f"params and shards ({expected})"
        )
    return manifest


def open_build(pattern: str) -> tuple[list[Path] | None, dict[str, str] | None]:
    """(local shard paths, {"id", "path"}) when `pattern` is a build directory, verified first;
    (None, None) for any other path or glob. What `Records` reads a build through."""
    if glob.has_magic(pattern) or not paths.path(paths.join(pattern, MANIFEST)).exists():
        return None, None
    manifest = verify(pattern)
    local = paths.local_copy(pattern)
    shards = [Path(local, s["file"]) for s in manifest["shards"]]
    return shards, {"id": manifest["id"], "path": pattern}
