"""How a command's exception becomes an exit code and a message (see posttrain/errors.py)."""

from __future__ import annotations

import errno
import os

from posttrain import errors

# A full disk or quota, a read-only filesystem, no permission: the place a command writes to
# refuses (the last two also for an OSError subclass other than PermissionError).
_PLACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def exit_code(e: BaseException) -> int:
    """The documented exit code (posttrain/errors.py) for a command that raised `e`."""
    from posttrain.train import TrainingDiverged

    if isinstance(e, TrainingDiverged):
        return errors.EXIT_DIVERGED
    if isinstance(e, errors.UserError):
        return errors.EXIT_USER
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return errors.EXIT_USER
    if isinstance(e, OSError) and e.errno in _PLACE_ERRNOS:
        return errors.EXIT_USER  # the destination, not the program: the user frees or moves it
    if isinstance(e, ValueError) and _raised_by_posttrain(e):
        return errors.EXIT_USER  # posttrain raises ValueError only for input it refuses
    return errors.EXIT_BUG


def _raised_by_posttrain(e: BaseException) -> bool:
    """Whether the innermost frame of `e`'s traceback is posttrain's own code (not a library's)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(package)


def message(e: BaseException) -> str:
    """`e` as the one line a user reads."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return str(e) or type(e).__name__
