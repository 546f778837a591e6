"""Whole exports: an export is staged in a folder of its own, then replaces the previous export
at its destination in an order that never leaves a loadable mix of the two (`_replace_export`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models._hf_export import barrier, filesystem

# What makes an export folder load (merged, PEFT): transformers and PEFT read nothing without it.
CONFIGS = ("config.json", "adapter_config.json")
INDEX = "model.safetensors.index.json"  # which shard holds each tensor


def _is_export_file(name: str) -> bool:
    """Whether an export (merged or PEFT) owns `name`. Tokenizer files and
    generation_config.json are not owned: no export writes them (users copy them in beside the
    weights, and posttrain's tokenizer reads its eos ids from generation_config.json)."""
    return name in CONFIGS or name == INDEX or name.endswith(".safetensors")


def check_export_destination(path: str, *, overwrite: bool = False) -> None:
    """Raises `UserError` unless an export may go to `path`, `ExportWriteError` when its
    filesystem is read-only (what `to_hf` checks first; a command calls it before loading a
    large checkpoint)."""
    _check_destination(paths.path(path), overwrite)
    _check_writable(paths.path(path))


def _check_writable(dest: epath.Path) -> None:
    """Refuses a local `dest` on a read-only filesystem (that of its nearest existing folder)."""
    if paths.is_remote(dest):
        return
    folder = os.path.abspath(os.fspath(dest))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        raise _refused(OSError(errno.EROFS, os.strerror(errno.EROFS)), dest, None, False)


def _check_destination(dest: epath.Path, overwrite: bool) -> None:
    """Refuses a destination that is a file, or a non-empty folder holding no export."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file; export into a directory")
    if overwrite or not dest.exists():
        return
    names = [p.name for p in dest.iterdir()]
    # A previous export is known by its weights, not its config: a kill midway through
    # `_replace_export` leaves weights without config.json, and the rerun must be accepted.
    if names and not any(n == INDEX or n.endswith(".safetensors") for n in names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(
            f"{dest} is not empty ({shown}) and holds no exported model; pick an empty "
            f"directory (e.g. {dest / 'hf'}) or pass --overwrite (overwrite=True) to export "
            "into it anyway"
        )


class ExportWriteError(OSError):
    """The destination refused an export (full disk or quota, read-only, no permission): its
    errno is the cause's, so `posttrain` exits 2 for it as for any such refusal
    (`posttrain.cli._errors`); the message names the destination, the cause and what was left
    there. The partial files are removed."""

    def __str__(self) -> str:
        return self.strerror


@contextlib.contextmanager
def staged_export(path: str, *, overwrite: bool = False, shared: bool = False) -> Iterator[str]:
    """An empty folder to write an export into; on success its files replace the export at
    `path` (`_replace_export`), on error it is removed and `path` is left as it was.

    Unshared, each process gets a local folder and only process 0's counts. Shared (every
    process writes part of the export), all get the same folder: a gs:// prefix beside a gs://
    `path`, else a local folder beside `path` that every process must see.

    Raises:
      UserError: `path` is not empty and holds no export, and `overwrite` is False; or, shared,
        some process does not see the local staging folder.
      ExportWriteError: a write failed (e.g. no space left on the device); the staging folder
        is removed, and `path` is as it was unless the failure came while the new files moved
        in (then it loads the previous export, or nothing until a rerun finishes).
    """
    dest = paths.path(path)
    _check_destination(dest, overwrite)
    _check_writable(dest)
    process_zero = jax.process_index() == 0
    beside = not paths.is_remote(path) and (process_zero or shared)
    staging, replacing = None, False
    try:
        if beside and process_zero:  # on the destination's filesystem: files move in by rename
            dest.parent.mkdir(parents=True, exist_ok=True)
        if shared:
            staging = _shared_staging(dest)
        else:  # gs:// (and processes other than 0, which write nothing): any local folder.
            staging = tempfile.mkdtemp(
                prefix=f".{dest.name}.export-", dir=os.fspath(dest.parent) if beside else None
            )
        yield staging
        if shared:
            barrier("posttrain-export-staged")
        if process_zero:
            replacing = True
            _replace_export(staging, dest)
        if shared:
            barrier("posttrain-export-replaced")
    except OSError as e:
        if e.errno is None or isinstance(e, ExportWriteError) or not _about(e, dest, staging):
            raise
        raise _refused(e, dest, staging, replacing) from e
    finally:
        if staging is not None and (process_zero or not shared):
            _remove_tree(staging)


def _about(e: OSError, dest: epath.Path, staging: str | None) -> bool:
    """Whether `e` is about the export's own files: it names none (a write), the staging
    folder's, `dest`'s or a folder above `dest` (made for it); not, e.g., a checkpoint's."""
    if not e.filename:
        return True
    named = os.path.abspath(os.fspath(e.filename))
    folders = [os.path.abspath(os.fspath(dest))] + ([os.path.abspath(staging)] if staging else [])
    return any(os.path.commonpath([named, f]) in (named, f) for f in folders)


def _refused(e: OSError, dest: epath.Path, staging: str | None, replacing: bool) -> OSError:
    """`e`, a failed write of the export to `dest`, as one line: the cause (and the file it
    names, unless a staging file), and what `dest` holds now."""
    cause = e.strerror or str(e)
    named = os.fspath(e.filename) if e.filename else ""
    if named and not (staging and named.startswith(staging)) and named != os.fspath(dest):
        cause += f" ({named})"
    if replacing:
        left = (
            f"its files were moving in: {dest} loads the previous export, or nothing (no "
            "config.json), until a rerun of the export finishes"
        )
    elif staging is None:
        left = "nothing was written"
    else:
        left = f"its partial files were removed and {dest} is as it was"
    return ExportWriteError(e.errno, f"exporting to {dest} failed: {cause}; {left}")


def _shared_staging(dest: epath.Path) -> str:
    """A staging folder beside `dest` named alike on every process (a token from process 0)."""
    token = np.frombuffer(secrets.token_hex(8).encode(), np.uint8)
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    staging = os.fspath(dest.parent / f".{dest.name}.export-{bytes(token).decode()}")
    if paths.is_remote(staging):
        return staging  # object stores have no folders to create
    if jax.process_index() == 0:
        os.makedirs(staging)
    barrier("posttrain-export-staging")
    seen = np.asarray([os.path.isdir(staging)])
    if jax.process_count() > 1 and not multihost_utils.process_allgather(seen).all():
        if jax.process_index() == 0:
            _remove_tree(staging)
        raise UserError(
            f"exporting to the local folder {dest} from {jax.process_count()} processes needs a "
            "filesystem they all share (e.g. NFS); export to a gs:// path instead"
        )
    return staging


def _remove_tree(folder: str) -> None:
    if not paths.is_remote(folder):
        shutil.rmtree(folder, ignore_errors=True)
    elif paths.path(folder).exists():
        filesystem(folder).rm(folder, recursive=True)


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
    On gs:// each step is an upload (a server-side copy from a gs:// staging prefix) or a
    delete (objects have no rename), in the same order.
    """
    remote = paths.is_remote(dest)
    dest.mkdir(parents=True, exist_ok=True)
    listed = dest.iterdir() if dest.exists() else ()  # gs:// has no empty folders
    old = {p.name for p in listed if _is_export_file(p.name) and p.is_file()}
    new = {p.name for p in paths.path(staging).iterdir()} if paths.path(staging).exists() else set()
    loaders = {INDEX, *CONFIGS}
    weights = new - loaders

    def remove(names) -> None:
        for name in sorted(names):
            (dest / name).unlink(missing_ok=True)

    def move_in(name: str) -> None:
        if paths.is_remote(staging):  # a server-side copy
            paths.move(paths.join(staging, name), dest / name)
        elif remote:
            paths.upload(os.path.join(staging, name), dest / name)
        else:
            os.replace(os.path.join(staging, name), dest / name)

    remove(old & set(CONFIGS))
    remove(old & {INDEX})
    for name in sorted(weights):
        move_in(name)
    remove(old - new - loaders)
    for name in [INDEX, *CONFIGS]:
        if name in new:
            move_in(name)
