"""Exact resume after SIGKILL and after SIGTERM (preemption), against an uninterrupted run."""

import os
import signal
import time

import jax
import numpy as np
import pytest

from posttrain.train import load_checkpoint_model
from tests.train.conftest import finish, start_run, train_losses

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
