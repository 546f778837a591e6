"""Exact resume after SIGKILL, after SIGTERM (preemption) and past damaged checkpoints, against
an uninterrupted run."""

import os
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import from_hf, to_hf
from posttrain.train import load_checkpoint_model
from tests.launch import finish
from tests.train.conftest import start_run, train_losses

STEPS = 12


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    finish(start_run(workdir))
    return workdir


def _wait_for(predicate, process, timeout=180.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            pytest.fail(
                f"the run ended before the test could interrupt it:\n"
                f"{process.communicate()[0][-3000:]}"
            )
        time.sleep(0.05)
    process.kill()
    pytest.fail("timed out waiting for the run")


def _committed(workdir, step) -> bool:
    return os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))


def _assert_same_run(a, b):
    assert train_losses(a) == train_losses(b)  # bitwise: floats compared exactly
    assert [s for s, _ in train_losses(a)] == list(range(1, STEPS + 1))
    params_a = load_checkpoint_model(str(a), STEPS).params
    params_b = load_checkpoint_model(str(b), STEPS).params
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_after_sigkill_is_exact(straight, tmp_path):
    process = start_run(tmp_path, step_delay=0.25)
    _wait_for(lambda: _committed(tmp_path, 4), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not _committed(tmp_path, STEPS)
    out = finish(start_run(tmp_path))
    assert f"STOPPED completed {STEPS}" in out
    _assert_same_run(straight, tmp_path)


def test_sigterm_saves_at_the_signal_then_resumes_exactly(straight, tmp_path):
    process = start_run(tmp_path, step_delay=0.25)
    _wait_for(
        lambda: (
            len(train_losses(tmp_path)) >= 6
            if os.path.exists(tmp_path / "metrics.jsonl")
            else False
        ),
        process,
    )
    process.send_signal(signal.SIGTERM)
    out = finish(process)
    stopped_at = int(out.split("STOPPED preempted ")[1].split()[0])
    assert 6 < stopped_at < STEPS and stopped_at % 4  # not a regular checkpoint step
    assert _committed(tmp_path, stopped_at)  # the save happened on the signal
    out = finish(start_run(tmp_path))
    assert f"STOPPED completed {STEPS}" in out
    _assert_same_run(straight, tmp_path)


def test_a_run_whose_newest_checkpoints_are_damaged_resumes_from_the_last_good_one(
    straight, tmp_path
):
    """Arrays of step 12 truncated and the JSON saved with step 8 cut: the next run moves both
    aside, resumes from step 4, ends as the uninterrupted run did, and its checkpoint exports."""
    workdir = tmp_path / "run"
    shutil.copytree(straight, workdir)
    checkpoints = workdir / "checkpoints"
    for root, _, files in os.walk(checkpoints / "12" / "state"):
        for name in files:
            if os.path.getsize(os.path.join(root, name)) > 1000:
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(100)
    config = checkpoints / "8" / "config" / "metadata"
    config.write_text(config.read_text()[:40])

    out = finish(start_run(workdir))
    assert f"STOPPED completed {STEPS}" in out
    assert "checkpoint 12 in" in out and "checkpoint 8 in" in out  # the warnings say so
    assert {"4", "8", "12", "8.corrupt", "12.corrupt"} <= set(os.listdir(checkpoints))
    _assert_same_run(straight, workdir)

    model = load_checkpoint_model(str(workdir))
    to_hf(model, str(tmp_path / "hf"))
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    np.testing.assert_array_equal(from_hf(str(tmp_path / "hf"))(tokens), model(tokens))
