"""Multi-process training on one CPU host: 2 processes x 4 fake devices over gloo against
1 process x 8 devices (same losses, a checkpoint one process restores), and a dead or stuck
process stopping the run with a clear error instead of a hang."""

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from posttrain.parallel import DistributedConfig, DistributedError, initialize
from tests.launch import finish, free_port, launch
from tests.tolerance import assert_close

TRAIN = [
    "train",
    "--config=configs/sft.py:tiny",
    "--config.data.shuffle=False",  # the same rows in each global batch, however split
    "--config.data.packing=False",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.progress=False",
    "--config.checkpoint.async_save=False",
]


def _launch(args, workdir, devices, process_id=None, num_processes=None, port=None):
    argv = ["-m", "posttrain.cli", *args, f"--workdir={workdir}"]
    return launch(argv, devices=devices, process_id=process_id, num_processes=num_processes,
                  port=port, stderr=subprocess.PIPE)  # fmt: skip


def _two_processes(args, workdir):
    port = free_port()
    return [_launch(args, workdir, 4, i, 2, port) for i in range(2)]


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if r["split"] == "train"]


def _finish(process, timeout=300):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out


# ~90 s; tests/rl/test_multihost.py checks the same for GRPO (2 processes = 1, restored in 1).
@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(tmp_path):
    args = [*TRAIN, "--config.train.steps=4"]
    pair = _two_processes(args, tmp_path / "two")
    single = _launch(args, tmp_path / "one", 8)
    for p in [*pair, single]:
        _finish(p)
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == len(one) == 4
    np.testing.assert_allclose(two, one, rtol=1e-6, atol=0)

    from posttrain.train import load_checkpoint_model

    # Written by both processes (each its shards and its data position), read by this one.
    restored = load_checkpoint_model(str(tmp_path / "two"))
    reference = load_checkpoint_model(str(tmp_path / "one"))
    for a, b in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(reference.params), strict=True
    ):
        assert_close(np.asarray(a), np.asarray(b), rtol=1e-5)  # (atol: 8 ulps of the largest)


def _start_long_run(tmp_path, timeout_s=20):
    args = [*TRAIN, "--config.train.steps=100000", f"--config.train.step_timeout_s={timeout_s}"]
    pair = _two_processes(args, tmp_path)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # until both processes are training
        time.sleep(1)
        path = tmp_path / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= 3:
            return pair
        if any(p.poll() is not None for p in pair):
            break
    for p in pair:
        p.kill()
    pytest.fail("the two-process run did not start: " + pair[0].communicate()[1][-3000:])


def _exits_within(process, seconds):
    start = time.monotonic()
    try:
        _, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the surviving process still ran {seconds} s after its peer stopped")
    return process.returncode, err, time.monotonic() - start


def test_a_killed_process_stops_the_other_with_a_clear_error(tmp_path):
    survivor, victim = _start_long_run(tmp_path)
    victim.kill()
    victim.communicate()
    code, err, _ = _exits_within(survivor, 60)
    assert code != 0
    assert "lost contact with another process" in err or "no training progress" in err, err[-2000:]


@pytest.mark.slow
def test_a_hung_process_trips_the_watchdog(tmp_path):
    survivor, victim = _start_long_run(tmp_path, timeout_s=15)
    victim.send_signal(signal.SIGSTOP)  # alive but silent: only the watchdog can tell
    try:
        code, err, seconds = _exits_within(survivor, 90)
    finally:
        victim.kill()
        victim.communicate()
    assert code == 3 and "no training progress" in err, err[-2000:]
    assert seconds < 60


def test_a_partial_multi_process_setup_is_refused(monkeypatch):
    for name in ("COORDINATOR", "NUM_PROCESSES", "PROCESS_ID"):
        monkeypatch.delenv(f"POSTTRAIN_{name}", raising=False)
    monkeypatch.setenv("POSTTRAIN_NUM_PROCESSES", "2")
    with pytest.raises(DistributedError, match="coordinator, process_id missing"):
        initialize()
    config = DistributedConfig.from_env(coordinator="h:1", process_id=5)
    assert (config.coordinator, config.num_processes, config.process_id) == ("h:1", 2, 5)
    with pytest.raises(DistributedError, match="outside 0..1"):
        initialize(config)
    monkeypatch.setenv("POSTTRAIN_PROCESS_ID", "one")
    with pytest.raises(DistributedError, match="not an integer"):
        DistributedConfig.from_env()
    monkeypatch.delenv("POSTTRAIN_NUM_PROCESSES")
    monkeypatch.delenv("POSTTRAIN_PROCESS_ID")
    assert initialize() is False  # one process: nothing to join


_POOL = """
import os
from posttrain.parallel import initialize
initialize()
import jax.numpy as jnp
(jnp.ones(4) + 1).block_until_ready()
names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
print("POOL", sum(n.startswith("tf_XLAEigen") for n in names), os.environ.get("PJRT_NPROC"))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_fake_cpu_devices_get_a_thread_pool_with_room_for_their_collectives():
    """XLA:CPU's pool has max(cores, devices) threads unless PJRT_NPROC says otherwise, and a
    collective holds its thread: with 8 fake devices a GRPO step could give every thread to
    some devices' collectives and hang (posttrain.parallel.size_cpu_thread_pool). `initialize`
    sizes the pool (4 threads per device) before JAX makes its CPU client, unless the user
    set PJRT_NPROC."""
    env = {"PJRT_NPROC": None}
    out = finish(launch(["-c", _POOL], devices=8, env=env))
    assert "POOL 32 32" in out, out[-2000:]
    out = finish(launch(["-c", _POOL], devices=8, env={"PJRT_NPROC": "12"}))
    assert "POOL 12 12" in out, out[-2000:]
