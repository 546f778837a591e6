"""A workdir on a filesystem that fills up or refuses writes: the run stops at once with one line,
leaves no partial checkpoint, and the next run (with space) resumes from the last good one and
ends bitwise as an uninterrupted run. The filesystem is a small tmpfs the test mounts (root
only: skipped with a message where mounting is not allowed)."""

import contextlib
import os
import subprocess

import jax
import numpy as np

from posttrain import cli
from posttrain.train import load_checkpoint_model
from tests.mounts import tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
RUN = ["train", f"--config={REPO}/configs/sft.py:tiny", "--config.model.checkpoint=",
       "--config.eval_data=[]", "--config.train.progress=false", f"--config.train.steps={STEPS}",
       "--config.checkpoint.every=2", "--config.train.log_every=1"]  # fmt: skip
CHECKPOINT_KB = 1720  # one checkpoint of the tiny model (du -sk checkpoints/2)


@contextlib.contextmanager
def _one_checkpoint_on_a_full_disk(tmp_path):
    """A Checkpointer on a tmpfs with room for one 800 KB (incompressible) checkpoint, step 1
    saved: yields `(checkpointer, disk, state)`; the next save fills the disk."""
    import jax.numpy as jnp

    from posttrain.train import CheckpointConfig, Checkpointer

    noise = np.random.RandomState(0).standard_normal(200_000)
    state = {"w": jnp.asarray(noise, jnp.float32)}
    with tmpfs(tmp_path / "disk", 1200) as disk:
        checkpointer = Checkpointer(str(disk / "run"), CheckpointConfig(every=1))
        checkpointer.save(1, state)
        checkpointer.wait()
        yield checkpointer, disk, state


def _losses(workdir) -> list[tuple[int, float]]:
    import json

    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


def test_a_full_disk_stops_the_run_and_the_next_run_resumes_exactly(tmp_path, capsys):
    straight = tmp_path / "straight"
    assert cli.main([*RUN, f"--workdir={straight}"]) == 0
    with tmpfs(tmp_path / "disk", CHECKPOINT_KB * 3 // 2) as disk:  # room for one checkpoint
        workdir = disk / "run"
        capsys.readouterr()
        assert cli.main([*RUN, f"--workdir={workdir}"]) == 2
        err = capsys.readouterr().err
        # Which write meets the full disk first is timing: the checkpoint, or TensorBoard's
        # thread (then reported at the next step's metrics). Either way one line, no traceback.
        checkpoint = (
            f"posttrain train: saving checkpoint 4 in {workdir}/checkpoints failed: No space left "
            "on device; the run stopped there and its partial files were removed. The last good "
            "checkpoint is step 2: free space (or fix the destination) and rerun to resume"
        )
        tensorboard = (
            f"posttrain train: TensorBoard events could not be written to {workdir}/tensorboard: "
            "No space left on device; free space (or fix the destination) and rerun to resume "
            "from the last checkpoint"
        )
        lines = err.splitlines()
        assert len(lines) == 2 and lines[0] in (checkpoint, tensorboard), err
        assert lines[1] == "(--debug shows the traceback)"
        assert os.listdir(workdir / "checkpoints") == ["2"]  # nothing newer, nothing partial

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert cli.main([*RUN, f"--workdir={workdir}"]) == 0
        assert "resumed from step 2" in capsys.readouterr().err
        assert _losses(workdir) == _losses(straight)  # bitwise: floats compared exactly
        resumed = load_checkpoint_model(str(workdir), STEPS).params
        for x, y in zip(jax.tree.leaves(load_checkpoint_model(str(straight), STEPS).params),
                        jax.tree.leaves(resumed), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_read_only_workdir_is_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", 1024, "ro") as readonly:
        assert cli.main([*RUN, f"--workdir={readonly}/run"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"posttrain train: Read-only file system: {readonly}/run",
            "(--debug shows the traceback)",
        ], err


def test_a_dead_tensorboard_writer_stops_the_run_instead_of_blocking_it(tmp_path):
    """tensorboardX's writer thread dies on a write error (here: ENOSPC on its first event);
    with its default 10-event queue the loop then blocked forever in `add_scalar` (seen in a
    clean-clone run of the full-disk test). Now the next write says so in one line."""
    import errno
    import time

    import pytest

    from posttrain.errors import UserError
    from posttrain.train._metrics import MetricsWriter

    metrics = MetricsWriter(str(tmp_path))
    events = metrics._tb._get_file_writer().event_writer._ev_writer

    def full(event):
        raise OSError(errno.ENOSPC, "No space left on device")

    events.write_event = full
    with pytest.raises(UserError, match="TensorBoard events could not be written"):
        for step in range(200):  # 20 scalars a step: far past the old queue's 10
            metrics.write(step, {f"m{i}": i for i in range(20)})
            time.sleep(0.01)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 1


def test_a_run_stopped_for_another_reason_leaves_no_partial_checkpoint(tmp_path):
    """A save still writing when the run stops for another reason (here an error raised at
    once; in a full-disk run, TensorBoard's write failing first) is waited for: its failure
    removes its partial files, and the run's own error is the one raised."""
    import pytest

    with _one_checkpoint_on_a_full_disk(tmp_path) as (checkpointer, disk, state):
        with pytest.raises(RuntimeError, match="the run's own error"):
            with checkpointer.settled():
                checkpointer.save(2, state)  # fails in the background: the disk is full
                raise RuntimeError("the run's own error")
        assert os.listdir(disk / "run" / "checkpoints") == ["1"]


def test_a_failed_save_still_listed_is_not_named_the_last_good_checkpoint(tmp_path):
    """Orbax lists a step as soon as its save starts. A full disk met on the main thread while
    a failed save is still listed (seen in a clean-clone run: "saving checkpoint 4 failed ...
    The last good checkpoint is step 4") names the newest checkpoint that finished."""
    import errno
    import time

    import pytest

    from posttrain.train._checkpoint import CheckpointWriteError

    with _one_checkpoint_on_a_full_disk(tmp_path) as (checkpointer, disk, state):
        checkpointer.save(2, state)  # fails in the background: the disk is full
        for _ in range(3000):
            if not checkpointer.manager.is_saving_in_progress():
                break
            time.sleep(0.01)
        assert checkpointer.latest_step() == 2  # listed, though its files are partial

        def full():
            raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(CheckpointWriteError, match="The last good checkpoint is step 1:"):
            checkpointer._checked(full)
        assert os.listdir(disk / "run" / "checkpoints") == ["1"]
        assert checkpointer.latest_step() == 1


def test_a_save_that_failed_in_the_background_stops_the_run_at_the_next_step(tmp_path):
    """`check` (called after every step) raises once a background save has failed; before, only
    the next save noticed, `checkpoint.every` steps later."""
    import time

    import pytest

    from posttrain.train._checkpoint import CheckpointWriteError

    with _one_checkpoint_on_a_full_disk(tmp_path) as (checkpointer, disk, state):
        checkpointer.save(2, state)
        with pytest.raises(CheckpointWriteError, match="checkpoint 2 .* checkpoint is step 1:"):
            for _ in range(3000):
                checkpointer.check()
                time.sleep(0.01)
        assert os.listdir(disk / "run" / "checkpoints") == ["1"]
