"""What every command that writes files checks before it reads anything (docs/data.md): no output
is one of its inputs (or inside an input folder) or another of its outputs, and none exists
already unless `--overwrite` is given. Paths are compared as the files they name: `a/../b`,
a symlink and a hard link to an input are that input."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping

from posttrain import paths
from posttrain.errors import UserError


def define_overwrite(flags, fv) -> None:
    flags.DEFINE_bool("overwrite", False, "replace outputs that exist already", flag_values=fv)


def check_flags(
    fv, inputs: Iterable[str], outputs: Iterable[str], more: Mapping[str, str] | None = None
) -> None:
    """`check_outputs` over flags of the parsed `fv`: `inputs` and `outputs` are flag names
    (a repeated flag: each of its values), `more` other outputs by label; --overwrite's value."""
    labels = {}
    for name in inputs:
        value = getattr(fv, name)
        for v in [value] if isinstance(value, str) else (value or ()):
            labels[f"--{name}={v}"] = v
    written = {f"--{name}={getattr(fv, name)}": getattr(fv, name) for name in outputs}
    check_outputs(labels, {**written, **(more or {})}, overwrite=fv.overwrite)


def check_outputs(
    inputs: Mapping[str, str | Iterable[str] | None],
    outputs: Mapping[str, str | None],
    *,
    overwrite: bool,
) -> None:
    """Raises UserError unless every output is new and is neither an input nor another output.

    Args:
      inputs: "--flag=value" label -> the file, glob or folder it reads (or several, or None).
      outputs: "--flag=value" label -> the file it writes (None or "": not written).
      overwrite: outputs that exist may be replaced (never an input, never twice).
    """
    read = []  # (label, where, is a folder)
    for label, value in inputs.items():
        for pattern in [value] if isinstance(value, str) else (value or ()):
            read += [(label, _where(name), _is_dir(name)) for name in _expand(pattern)]
    written: list[tuple[tuple, str]] = []
    for label, path in outputs.items():
        if not path:
            continue
        where = _where(path)
        for in_label, in_where, folder in read:
            if _same(where, in_where):
                raise UserError(
                    f"{label} is also an input ({in_label}): writing it would destroy what is "
                    "read; write to another path"
                )
            if folder and where[0].startswith(in_where[0].rstrip("/") + "/"):
                raise UserError(
                    f"{label} is inside the input folder {in_label}: writing it would change "
                    "what is read; write to another path"
                )
        for other, other_label in written:
            if _same(where, other):
                raise UserError(
                    f"{label} and {other_label} are the same file; give each output its own path"
                )
        written.append((where, label))
        if not overwrite and _exists(path):
            raise UserError(f"{label} exists; pass --overwrite to replace it, or write elsewhere")


def _expand(pattern: str) -> list[str]:
    """The paths a file, glob or folder names (a glob matching nothing: none)."""
    if not glob.has_magic(pattern):
        return [pattern]
    if paths.is_remote(pattern):
        return paths.glob(pattern)
    return glob.glob(os.path.expanduser(pattern), recursive=True)


def _where(path: str) -> tuple[str, tuple[int, int] | None]:
    """(resolved absolute path or gs:// URL, (device, inode) of a local file that exists)."""
    if paths.is_remote(path):
        return str(path).rstrip("/"), None
    full = os.path.realpath(os.path.expanduser(path))
    try:
        st = os.stat(full)
    except OSError:
        return full, None
    return full, (st.st_dev, st.st_ino)


def _same(a, b) -> bool:
    """Whether two `_where`s name one file (a hard link is the file it links)."""
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


def _is_dir(path: str) -> bool:
    return not paths.is_remote(path) and os.path.isdir(os.path.expanduser(path))


def _exists(path: str) -> bool:
    if paths.is_remote(path):
        return paths.path(path).exists()
    return os.path.lexists(os.path.expanduser(path))
