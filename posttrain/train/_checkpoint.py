"""Orbax checkpoints: async saves, keep-last-K plus keep-best, resharding restore, fallback.

A checkpoint holds the train state (params, optimizer state, step, rng, counters), the data
iterator state of every process, the run config and the dataset manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as policies

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models import checkpoint_items

log = logging.getLogger(__name__)


class NonFiniteStateError(RuntimeError):
    """A train state with NaN or infinite values, which is never saved."""


class CheckpointWriteError(UserError):
    """A save the destination refused (full disk or quota, read-only, no permission): the run
    stops at once; what the failed save had written is removed."""


# Causes a user fixes at the destination; any other failure of a save is raised as it is.
_PLACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
_TMP = ".orbax-checkpoint-tmp"


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every floating-point value in `tree` is finite (one fused device reduction)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # save every N steps (and at the end, on SIGTERM and on a NaN stop)
    keep_last: int = 3  # most recent checkpoints kept (0: keep every checkpoint)
    keep_best: int = 1  # checkpoints with the lowest eval loss kept in addition (0: none)
    async_save: bool = True  # write in a background thread while training continues

    def __post_init__(self):
        if self.every < 1:
            raise ValueError(f"checkpoint.every={self.every}: save every N >= 1 steps")
        if self.keep_last < 0 or self.keep_best < 0:
            raise ValueError(
                "checkpoint.keep_last and checkpoint.keep_best must be >= 0 (keep_last=0 keeps "
                "every checkpoint; the newest is always kept)"
            )


class _QuietPlaceErrors(logging.Filter):
    """Drops the logs of a save the destination refused (Orbax's threads log each failure with
    a traceback, hundreds of lines, and asyncio its futures' unread exceptions): `Checkpointer`
    reports that failure in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            if "orbax" not in record.pathname:
                return True
            error = Exception(record.getMessage())
        return _os_error(error) not in _PLACE_ERRNOS


_quiet = _QuietPlaceErrors()
_NOISY = ("absl", "asyncio")  # (Orbax logs through absl)


class Checkpointer:
    """Saves and restores train states under `<workdir>/checkpoints/<step>`."""

    def __init__(self, workdir: str, config: CheckpointConfig):
        for name in _NOISY:
            if _quiet not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_quiet)
        self.directory = paths.path(workdir) / "checkpoints"  # local or gs://
        self.every = config.every
        keep = [policies.LatestN(n=config.keep_last or None)]  # None: all; never fewer than 1
        if config.keep_best:
            keep.append(
                policies.BestN(
                    get_metric_fn=lambda m: m["eval_loss"],
                    reverse=True,  # sorted high to low: the last n are the lowest losses
                    n=config.keep_best,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep),
            enable_async_checkpointing=config.async_save,
            save_interval_steps=1,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self,
        step: int,
        state,
        *,
        data_state: dict | None = None,
        extra: dict | None = None,
        metrics: dict | None = None,
        force: bool = False,
    ) -> bool:
        """Starts writing `state` at `step` (async); `extra` holds JSON items (config, manifest).

        Every process calls this; each contributes its shards and its own data-iterator state.
        A state holding a NaN or an infinity is refused (`NonFiniteStateError`): a resume would
        continue from it.
        """
        if not bool(_all_finite(state)):
            raise NonFiniteStateError(
                f"refusing to save step {step}: the train state holds NaN or infinite values "
                "(the updates that made them were skipped, so they came with the starting "
                "weights: check model.checkpoint / model.hf_path)"
            )
        items = {"state": ocp.args.StandardSave(state)}
        data = {f"process_{jax.process_index()}": data_state} if data_state is not None else {}
        items["data"] = ocp.args.JsonSave(data)
        for name, value in (extra or {}).items():
            items[name] = ocp.args.JsonSave(value)
        return self._checked(
            self.manager.save, step, args=ocp.args.Composite(**items), metrics=metrics, force=force
        )

    def wait(self) -> None:
        """Waits for the save in the background; raises `CheckpointWriteError` if it failed."""
        self._checked(self.manager.wait_until_finished)

    def check(self) -> None:
        """Raises `CheckpointWriteError` if a save in the background has failed (cheap: called
        after every step, so that a run stops at the step it noticed, not at its next save)."""
        self._checked(self.manager.check_for_errors)
        if not self.manager.is_saving_in_progress():
            self.wait()  # the manager's own finalize thread keeps its error until waited for

    @contextlib.contextmanager
    def settled(self):
        """Runs the block; if it raises, first waits for a save still in flight, so that one
        failing (a full disk that also stopped the run's metrics) leaves no partial files. The
        block's own error is the one raised."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(CheckpointWriteError):
                self.wait()
            raise

    def _checked(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            code = _os_error(e)
            if code not in _PLACE_ERRNOS:
                raise
            steps = self._remove_partial()
            # The manager lists a save as soon as it starts: re-read what is finished on disk.
            with contextlib.suppress(Exception):
                self.manager.reload()
            last = max((s for s in self.manager.all_steps() if s not in steps), default=None)
            which = f"checkpoint {', '.join(map(str, steps))}" if steps else "a checkpoint"
            raise CheckpointWriteError(
                f"saving {which} in {self.directory} "
                f"failed: {os.strerror(code)}; the run stopped there and its partial files "
                f"were removed. The last good checkpoint is "
                f"{'step ' + str(last) if last is not None else 'none'}: free space (or fix the "
                "destination) and rerun to resume"
            ) from e

    def _remove_partial(self) -> list[int]:
        """Removes the temporary folders of saves that did not finish; returns their steps."""
        if jax.process_index() != 0 or not self.directory.exists():
            return []
        steps = []
        for path in self.directory.iterdir():
            if _TMP in path.name:
                steps.append(int(path.name.split(".")[0]))
                path.rmtree(missing_ok=True)
        return sorted(steps)

    def restore(self, abstract_state, *, step: int | None = None):
        """Restores the newest readable checkpoint onto `abstract_state`'s shardings.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings, possibly on a
        different mesh than the one that saved: Orbax reads each device's shard directly. A
        checkpoint that fails to load (any file: arrays, JSON, metadata; corrupt or partial) is
        skipped with a warning and the previous one is tried; once one loads, those that did
        not are moved aside to `checkpoints/<step>.corrupt`, so the run saves their steps again
        normally and `keep_last` never counts them. When none loads nothing is moved (the state
        the run expects may be what changed, e.g. the LoRA rank) and the error names each. An
        explicit `step` is never moved aside: its error is raised.

        Returns:
          (step, state, data_state of this process or None, extra JSON items) or None when the
          directory holds no checkpoint.
        """
        steps = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
        failed: dict[int, str] = {}
        for candidate in steps:
            try:
                restored = self.manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        data=ocp.args.JsonRestore(),
                    ),
                )
                extra = self.read_json(candidate)
            except Exception as e:  # orbax/tensorstore/json raise many types for damaged files
                if step is not None:
                    raise
                failed[candidate] = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning(
                    "checkpoint %d in %s is unreadable (%s); trying the previous one",
                    candidate, self.directory, failed[candidate],
                )  # fmt: skip
                continue
            for bad, reason in failed.items():
                self._quarantine(bad, reason)
            data = (restored.data or {}).get(f"process_{jax.process_index()}")
            return candidate, restored.state, data, extra
        if failed:
            raise RuntimeError(
                f"no checkpoint in {self.directory} restores onto this run's state (left in "
                "place; if the config changed what is trained, e.g. model or LoRA settings, "
                "restore them or train in a new workdir):\n"
                + "\n".join(f"step {s}: {reason}" for s, reason in failed.items())
            )
        return None

    def _quarantine(self, step: int, reason: str) -> None:
        """Moves checkpoint `step` to `<step>.corrupt` (process 0; the others wait for it)."""
        target = self.directory / f"{step}.corrupt"
        log.warning("moved unreadable checkpoint %d (%s) to %s", step, reason, target)
        if jax.process_index() == 0:
            if target.exists():
                target.rmtree()  # an older quarantine of the same step
            paths.move(self.directory / str(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
        self.manager.reload()  # forget the step, so it is saved again normally

    def read_json(self, step: int) -> dict:
        """The JSON items (config, manifest, ...) saved with `step`, read without orbax args."""
        return checkpoint_items(self.directory, step)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _os_error(e: BaseException) -> int | None:
    """The errno behind a failed save: an OSError's, or the one tensorstore names in its text
    ("[os_error_code='28']"), or one of the messages the C library words."""
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError) and cause.errno:
            return cause.errno
    text = str(e)
    if found := re.search(r"os_error_code='(\d+)'", text):
        return int(found.group(1))
    for code in _PLACE_ERRNOS:
        if os.strerror(code) in text:
            return code
    return None
