"""The data tools' parallel pass (`posttrain.curate._chunks.map_chunks`) starts worker
processes only when the input pays for them: the first chunk runs in the calling process,
timed, and the rest go to a pool only when splitting them saves more than `POOL_START_S`."""

import os
import time

import pytest

from posttrain.curate import _chunks
from posttrain.data import Records
from tests.data.conftest import write_records


def where(records: list[dict], sleep_s: float) -> tuple[int, list[int]]:
    """(the process that ran this chunk, its records' ids), after `sleep_s` of "work"."""
    time.sleep(sleep_s)
    return os.getpid(), [r["id"] for r in records]


@pytest.fixture
def source(tmp_path):
    return Records(str(write_records(tmp_path / "r.jsonl", [{"id": i} for i in range(10)])))


def test_a_small_input_never_waits_for_workers(source):
    """Chunks that take no time: every one runs here however many workers are allowed, in
    order (a pool would take seconds to start and save nothing)."""
    out = list(_chunks.map_chunks([source], where, (0.0,), workers=2, chunk=3, progress=False))
    assert [task for task, _ in out] == [(0, 0, 3), (0, 3, 6), (0, 6, 9), (0, 9, 10)]
    assert [pid for _, (pid, _) in out] == [os.getpid()] * 4
    assert [i for _, (_, ids) in out for i in ids] == list(range(10))


@pytest.mark.slow  # (two spawned workers import posttrain.curate: ~3-10 s)
def test_an_input_that_pays_for_workers_gets_them(source, monkeypatch):
    """When the first chunk's time says the rest, split over the workers, save more than a
    pool's start (here made 0.1 s; each chunk takes 0.2 s, three are left: 0.3 s saved), the
    first chunk runs here and the others in worker processes, results still in order."""
    monkeypatch.setattr(_chunks, "POOL_START_S", 0.1)
    out = list(_chunks.map_chunks([source], where, (0.2,), workers=2, chunk=3, progress=False))
    pids = [pid for _, (pid, _) in out]
    assert pids[0] == os.getpid() and os.getpid() not in pids[1:], pids
    assert [i for _, (_, ids) in out for i in ids] == list(range(10))
