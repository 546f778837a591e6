"""Errors a user can fix, and the exit codes `posttrain` commands end with.

A `UserError` (a bad config value, flag, data file, path, model directory or checkpoint) is
printed by the CLI as one message naming the thing and the fix, with exit code 2 and no
traceback (`--debug` or `POSTTRAIN_DEBUG=1` shows it). Anything else is a bug: its traceback is
printed and the exit code is 1. The codes are documented in docs/training.md ("When things go
wrong") for schedulers that decide whether to requeue a job.
"""

from __future__ import annotations

EXIT_OK = 0  # finished: the configured steps are done (or the command did its work)
EXIT_BUG = 1  # an internal error: a traceback was printed
EXIT_USER = 2  # a user error: fix what the message names and rerun
EXIT_WATCHDOG = 3  # a step hung past train.step_timeout_s (a peer or the device is stuck)
EXIT_DIVERGED = 4  # train.max_bad_steps non-finite steps in a row: saved, stopped
EXIT_PREEMPTED = 75  # SIGTERM: saved a checkpoint; rerun the same command to resume (EX_TEMPFAIL)


class UserError(Exception):
    """A mistake the user can fix; its message says what to change."""


class WorkdirBusyError(UserError):
    """Another live run holds the workdir's lock."""
