"""Paths that are local or in object storage (`gs://...`): the one layer every user path uses.

`path(p)` gives an `etils.epath.Path` (what Orbax takes), so `open`, `exists`, `iterdir`,
`glob`, `mkdir` work the same on a local folder and on a bucket; gs:// goes through gcsfs
(fsspec). Object stores cannot append to an object or rename it atomically, so writers that
append (metrics) keep their lines and rewrite the object (see `train/_metrics.py`), and readers
that need a real local file (safetensors' mmap, `pread` on JSON lines, tokenizers) take
`local_copy(p)`, a cached download.

Emulators: when `STORAGE_EMULATOR_HOST` is set (the variable Google's client libraries and
gcsfs read), every gs:// client here talks to it: gcsfs and google-cloud-storage read it
themselves; tensorstore (Orbax's array I/O) is pointed at it through `TENSORSTORE_GCS_HTTP_URL`,
and gcsfs is told to use no credentials. A user sets only that one variable.
"""

from __future__ import annotations

import functools
import glob as pyglob
import os

from etils import epath


def is_remote(p: str | os.PathLike) -> bool:
    """Whether `p` is an object-storage URL (`gs://bucket/...`) rather than a local path."""
    return "://" in os.fspath(p)


def path(p: str | os.PathLike) -> epath.Path:
    """`p` as an `epath.Path`: a URL as given, a local path expanded (`~`) and made absolute."""
    s = os.fspath(p)
    if is_remote(s):
        _configure_object_storage()
        return epath.Path(s)
    return epath.Path(os.path.abspath(os.path.expanduser(s)))


def join(p: str | os.PathLike, *parts: str) -> str:
    """`path(p) / parts...` as a string (for APIs and JSON that take strings)."""
    return os.fspath(path(p).joinpath(*parts))


def glob(pattern: str) -> list[str]:
    """The paths a glob names, sorted; `*`, `?`, `[...]` and `**` (any depth) work on gs:// too."""
    if not is_remote(pattern):
        return sorted(pyglob.glob(os.path.expanduser(pattern), recursive=True))
    # epath refuses `**` on object storage; fsspec lists the prefix once and matches it.
    scheme = pattern.split("://", 1)[0]
    return sorted(f"{scheme}://{p}" for p in _filesystem(pattern).glob(pattern))


def _files_under(folder: epath.Path) -> list[epath.Path]:
    """Every file below `folder`, at any depth."""
    if not is_remote(folder):
        return sorted(
            path(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files
        )
    scheme = os.fspath(folder).split("://", 1)[0]
    return [path(f"{scheme}://{p}") for p in sorted(_filesystem(folder).find(os.fspath(folder)))]


def _filesystem(url: str | os.PathLike):
    import fsspec

    path(url)  # configures the emulator, if any, before the filesystem is made
    return fsspec.core.url_to_fs(os.fspath(url))[0]


def cache_dir() -> epath.Path:
    """Where `local_copy` keeps downloads: `$POSTTRAIN_CACHE`, else ~/.cache/posttrain/objects."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "posttrain", "objects")
    return path(os.environ.get("POSTTRAIN_CACHE", default))


def local_copy(p: str | os.PathLike, *, skip: tuple[str, ...] = ()) -> str:
    """A local path holding what `p` holds: `p` itself when local, else a cached download of the
    object or of every object under the prefix (a model or tokenizer directory) whose name does
    not end with one of `skip` (a tokenizer leaves a model directory's weights where they are).

    A cached file is downloaded again when its size or modification time differs from the
    object's, and a cached file whose object is gone is deleted, so a changed prefix is never
    read stale.
    """
    src = path(p)
    if not is_remote(p):
        return os.fspath(src)
    scheme, rest = os.fspath(p).split("://", 1)
    dst = cache_dir() / scheme / rest.strip("/")
    if src.is_dir():
        files = [f for f in _files_under(src) if not (skip and f.name.endswith(skip))]
        wanted = {dst / child.relative_to(src) for child in files}
        for child in files:
            _download(child, dst / child.relative_to(src))
        for cached in _files_under(dst):  # objects deleted since (a re-export's old shards)
            if cached not in wanted:
                cached.unlink()
    else:
        _download(src, dst)
    return os.fspath(dst)


def _download(src: epath.Path, dst: epath.Path) -> None:
    stat = src.stat()
    if dst.exists():
        local = os.stat(dst)
        if local.st_size == stat.length and int(local.st_mtime) == int(stat.mtime):
            return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")  # a kill never leaves half a file
    src.copy(tmp, overwrite=True)
    os.utime(tmp, (stat.mtime, stat.mtime))
    os.replace(tmp, dst)


def upload(local: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies a local file, or every file under a local folder, to `dst` (local or URL)."""
    local, out = path(local), path(dst)
    if not local.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        local.copy(out, overwrite=True)
        return
    for child in _files_under(local):
        upload(child, out / child.relative_to(local))


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Moves a file or folder: a rename locally; on object storage a server-side copy of every
    object, then their deletion (stores have no rename; gcsfs's move first tries an API only
    hierarchical-namespace buckets have)."""
    if not is_remote(src):
        os.replace(path(src), path(dst))
        return
    from etils.epath import backend

    # epath's own filesystem, whose cached listings (which Orbax reads) the change updates.
    fs = backend.fsspec_backend.fs(os.fspath(path(src)))
    fs.copy(os.fspath(src), os.fspath(dst), recursive=True)
    fs.rm(os.fspath(src), recursive=True)


def write_text(p: str | os.PathLike, text: str) -> None:
    """`write_bytes` of `text` in UTF-8."""
    write_bytes(p, text.encode())


def write_bytes(p: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `p` whole, creating its folder; a local file is replaced atomically (a
    kill leaves the old or the new one), an object by one upload (object writes are atomic)."""
    target = path(p)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(p):
        target.write_bytes(data)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def _configure_object_storage() -> None:
    """Points tensorstore and gcsfs at `STORAGE_EMULATOR_HOST` when it is set."""
    if host := os.environ.get("STORAGE_EMULATOR_HOST"):
        _use_emulator(host)


@functools.cache
def _use_emulator(host: str) -> None:
    """Sets what gcsfs and tensorstore need to reach the emulator at `host` (once per host)."""
    if "://" not in host:  # Google's client libraries (google-cloud-storage) need the scheme
        host = os.environ["STORAGE_EMULATOR_HOST"] = f"http://{host}"
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = host
    # gcsfs asks Google's storage-control API (not emulated) for each bucket's layout unless
    # its zonal-bucket support is off; read when gcsfs is first imported, which is after this.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec

    fsspec.config.conf.setdefault("gcs", {}).setdefault("token", "anon")


def pid_alive(pid: int) -> bool:
    """Whether local process `pid` runs (in this pid namespace): what tells a lock or a staging
    file left by a killed process from one whose writer still works."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
