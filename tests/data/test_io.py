"""Record streams of the data tools: every format round-trips, outputs appear whole or not at
all, and the same records give the same bytes."""

import pytest

from posttrain.data import RecordWriter, _io, read_records

RECORDS = [{"prompt": "p0"}, {"prompt": "p1", "completion": "é 1"}, {"text": "t2", "n": 2}]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet", "arrayrecord"])
def test_records_round_trip_byte_identically(tmp_path, suffix):
    paths = [tmp_path / f"{name}.{suffix}" for name in ("a", "b")]
    for path in paths:
        with RecordWriter(str(path)) as writer:
            for record in RECORDS:
                writer.write(record)
    assert [r for r, _ in read_records(str(paths[0]))] == RECORDS  # (fields absent stay absent)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_a_failed_write_leaves_nothing_and_parquet_refuses_new_fields(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError), RecordWriter(str(tmp_path / "out.jsonl")) as writer:
        writer.write({"a": 1})
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file
    monkeypatch.setattr(_io, "ROW_GROUP", 2)
    with pytest.raises(ValueError, match=r"add fields \['b'\].*write .jsonl or .arrayrecord"):
        with RecordWriter(str(tmp_path / "out.parquet")) as writer:
            for record in [{"a": 1}, {"a": 2}, {"a": 3, "b": 4}]:
                writer.write(record)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unsupported suffix '.csv'"):
        RecordWriter(str(tmp_path / "out.csv"))


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_outputs_take_the_users_umask(tmp_path, umask):
    import os

    old = os.umask(umask)
    try:
        for suffix in ("jsonl", "parquet", "arrayrecord"):
            with RecordWriter(str(tmp_path / f"out.{suffix}")) as writer:
                writer.write(RECORDS[0])
            assert (tmp_path / f"out.{suffix}").stat().st_mode & 0o777 == 0o666 & ~umask
    finally:
        os.umask(old)


def test_a_killed_writers_staging_file_is_cleared_by_the_next_one(tmp_path):
    import os

    dead = tmp_path / f".out.jsonl.{_dead_pid()}.k1ll3d.part"  # a run killed mid-write
    live = tmp_path / f".out.jsonl.{os.getpid()}.w0rk1n.part"  # a writer of this process
    other = tmp_path / f".other.jsonl.{_dead_pid()}.x.part"  # another output's: not ours
    longer = tmp_path / f".out.jsonl.5.{_dead_pid()}.y.part"  # out.jsonl.5's: not ours either
    for path in (dead, live, other, longer):
        path.write_text("partial")
    with RecordWriter(str(tmp_path / "out.jsonl")) as writer:
        writer.write(RECORDS[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out.jsonl", live.name, other.name, longer.name]
    )
