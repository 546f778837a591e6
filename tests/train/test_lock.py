"""The workdir lease: one live run per workdir, and a crashed run's lease taken over."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from posttrain.errors import EXIT_USER, WorkdirBusyError
from posttrain.train import WorkdirLock, _lock
from tests.train.conftest import REPO, start_run, train_losses

FAST = dict(lease_s=1.0, settle_s=0.05)


def _record(workdir) -> dict:
    with open(os.path.join(workdir, "lock.json")) as f:
        return json.load(f)


def _write_record(workdir, **fields) -> None:
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_namespace": _lock._pid_namespace(),
        "started": "2026-12-01T00:00:00+00:00",
        "token": "someone-else",
        "heartbeat": time.time(),
        "lease_s": 1.0,
        **fields,
    }
    with open(os.path.join(workdir, "lock.json"), "w") as f:
        json.dump(record, f)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_second_lock_is_refused_naming_the_holder_until_released(tmp_path):
    first = WorkdirLock(str(tmp_path), **FAST)
    with first:
        assert _record(tmp_path)["pid"] == os.getpid()
        with pytest.raises(WorkdirBusyError) as refused:
            WorkdirLock(str(tmp_path), **FAST).acquire()
        message = str(refused.value)
        for part in (f"pid {os.getpid()}", socket.gethostname(), first._started, "lock.json"):
            assert part in message
        assert "expires 1 s after its last heartbeat" in message
    assert not (tmp_path / "lock.json").exists()
    with WorkdirLock(str(tmp_path), **FAST):  # free again
        pass


def test_the_lock_is_released_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError), WorkdirLock(str(tmp_path), **FAST):
        raise RuntimeError("the run failed")
    assert not (tmp_path / "lock.json").exists()


def test_heartbeats_keep_a_live_lease(tmp_path):
    with WorkdirLock(str(tmp_path), lease_s=0.3, settle_s=0.05):
        first_beat = _record(tmp_path)["heartbeat"]
        time.sleep(0.8)  # over two leases
        assert _record(tmp_path)["heartbeat"] > first_beat
        with pytest.raises(WorkdirBusyError):
            WorkdirLock(str(tmp_path), **FAST).acquire()


def test_a_lease_without_heartbeats_expires_and_is_taken_over(tmp_path):
    hung = WorkdirLock(str(tmp_path), **FAST)
    hung.acquire()
    hung._stop.set()  # a holder that stopped beating (hung or on a host that is gone)
    hung._thread.join()
    with pytest.raises(WorkdirBusyError):
        WorkdirLock(str(tmp_path), **FAST).acquire()
    time.sleep(1.1)
    with WorkdirLock(str(tmp_path), **FAST) as taker:
        assert _record(tmp_path)["token"] == taker._token
        hung._thread = None  # what release would see: no longer this holder's file
        assert not hung._owned()


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    _write_record(tmp_path, pid=_dead_pid(), lease_s=600.0)
    with WorkdirLock(str(tmp_path), **FAST) as lock:
        assert _record(tmp_path)["token"] == lock._token
    # On another host the pid says nothing: only the lease decides.
    _write_record(tmp_path, pid=_dead_pid(), lease_s=600.0, host="elsewhere")
    with pytest.raises(WorkdirBusyError, match="host elsewhere"):
        WorkdirLock(str(tmp_path), **FAST).acquire()


def test_a_holder_that_lost_its_lease_leaves_the_new_file(tmp_path):
    lock = WorkdirLock(str(tmp_path), lease_s=0.3, settle_s=0.05)
    lock.acquire()
    _write_record(tmp_path)  # taken over while this holder stalled
    time.sleep(0.3)
    assert lock.lost
    lock.release()
    assert _record(tmp_path)["token"] == "someone-else"


def test_run_lock_is_taken_once_per_run_and_only_by_process_0(tmp_path, monkeypatch):
    _lock.claim(str(tmp_path))  # `setup` takes it ...
    with _lock.run_lock(str(tmp_path)):  # ... and `train` keeps it, then releases it
        assert _record(tmp_path)["pid"] == os.getpid()
    assert not (tmp_path / "lock.json").exists()
    monkeypatch.setattr(_lock.jax, "process_index", lambda: 1)
    with _lock.run_lock(str(tmp_path)):
        assert not (tmp_path / "lock.json").exists()


def test_a_lock_in_a_bucket(gcs_bucket):
    workdir = f"{gcs_bucket}/locked"
    with WorkdirLock(workdir, **FAST) as first:
        assert first._owned()
        with pytest.raises(WorkdirBusyError, match=f"pid {os.getpid()}"):
            WorkdirLock(workdir, **FAST).acquire()
    assert not first._fs.exists(first.path)
    with WorkdirLock(workdir, **FAST):
        pass


def test_two_runs_on_one_workdir_only_one_trains(tmp_path):
    first = start_run(tmp_path, step_delay=0.5)
    config = tmp_path / "config.json"
    deadline = time.time() + 240
    while not config.exists():
        if first.poll() is not None or time.time() > deadline:
            first.kill()
            pytest.fail(f"the first run wrote no config.json:\n{first.communicate()[0][-3000:]}")
        time.sleep(0.1)
    written = config.stat().st_mtime_ns

    second = subprocess.run(  # through the CLI, as a user would start it
        [sys.executable, "-m", "posttrain", "train", "--config=configs/sft.py:tiny",
         f"--workdir={tmp_path}"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert second.returncode == EXIT_USER, second.stderr[-3000:]
    assert f"in use by another run: host {socket.gethostname()}, pid {first.pid}" in second.stderr
    assert first.poll() is None  # refused while the first still ran, not after it finished
    assert config.stat().st_mtime_ns == written

    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    assert "STOPPED completed 12" in out
    assert [step for step, _ in train_losses(tmp_path)] == list(range(1, 13))  # each once
    assert not (tmp_path / "lock.json").exists()
