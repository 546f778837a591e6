"""Whole exports: an export is staged in a folder of its own, then replaces the previous export
at its destination in an order that never leaves a loadable mix of the two (`_replace_export`).
"""

from __future__ import annotations

import contextlib
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
    if names and not any(n == INDEX or n.endswith(".safetensors") for n in names):
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(
            f"{dest} is not empty ({shown}) and holds no exported model; pick an empty "
            f"directory (e.g. {dest / 'hf'}) or pass --overwrite (overwrite=True) to export "
            "into it anyway"
        )


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
    """
    dest = paths.path(path)
    _check_destination(dest, overwrite)
    process_zero = jax.process_index() == 0
    beside = not paths.is_remote(path) and (process_zero or shared)
    if beside and process_zero:  # on the destination's filesystem, so files move in by rename
        dest.parent.mkdir(parents=True, exist_ok=True)
    if shared:
        staging = _shared_staging(dest)
    else:  # gs:// (and processes other than 0, which write nothing): any local folder.
        staging = tempfile.mkdtemp(
            prefix=f".{dest.name}.export-", dir=os.fspath(dest.parent) if beside else None
        )
    try:
        yield staging
        if shared:
            barrier("posttrain-export-staged")
        if process_zero:
            _replace_export(staging, dest)
        if shared:
            barrier("posttrain-export-replaced")
    finally:
        if process_zero or not shared:
            _remove_tree(staging)


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
