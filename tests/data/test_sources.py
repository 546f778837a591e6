"""Record files: random access by record index, locations, hashes, and missing/empty files."""

import hashlib
import json

import pytest

from posttrain.data import SourceConfig
from posttrain.data._sources import Records
from tests.data.conftest import write_records

RECORDS = [{"text": f"doc {i}"} for i in range(7)]


def test_jsonl_skips_blank_lines_and_reports_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\r\n \n{"text": "c"}')  # no final newline
    recs = Records(str(path))
    assert len(recs) == 3
    got = [recs[i] for i in range(3)]
    assert [json.loads(raw) for raw, _ in got] == [{"text": t} for t in "abc"]
    assert [where for _, where in got] == [f"{path} line {n}" for n in (1, 3, 5)]


@pytest.mark.parametrize("suffix, unit", [(".parquet", "row"), (".arrayrecord", "record")])
def test_binary_formats_read_every_record_with_its_index(tmp_path, suffix, unit):
    path = write_records(tmp_path / f"a{suffix}", RECORDS)  # parquet: row groups of 3
    recs = Records(str(path))
    assert len(recs) == len(RECORDS)
    for i in reversed(range(len(RECORDS))):  # across row groups, backwards
        raw, where = recs[i]
        assert (raw if isinstance(raw, dict) else json.loads(raw)) == RECORDS[i]
        assert where == f"{path} {unit} {i}"


def test_parquet_drops_null_columns(tmp_path):
    path = write_records(
        tmp_path / "m.parquet", [{"text": "a"}, {"prompt": "p", "completion": "c"}]
    )
    recs = Records(str(path))
    assert recs[0][0] == {"text": "a"} and recs[1][0] == {"prompt": "p", "completion": "c"}


def test_glob_concatenates_sorted_files_and_describes_them(tmp_path):
    b = write_records(tmp_path / "d" / "b.jsonl", RECORDS[3:])
    a = write_records(tmp_path / "d" / "a.jsonl", RECORDS[:3])
    recs = Records(str(tmp_path / "d" / "*.jsonl"))
    assert [json.loads(recs[i][0]) for i in range(len(recs))] == RECORDS
    assert recs[3][1] == f"{b} line 1"
    assert recs.describe() == [
        {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "records": n}
        for p, n in ((a, 3), (b, 4))
    ]


def test_missing_and_unusable_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        Records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"glob .*\*.parquet' matches no file"):
        Records(str(tmp_path / "*.parquet"))
    with pytest.raises(FileNotFoundError, match="is a directory"):
        Records(str(tmp_path))
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(ValueError, match="a.csv has an unsupported suffix"):
        Records(str(tmp_path / "a.csv"))


@pytest.mark.parametrize("name", ["e.jsonl", "e.parquet", "e.arrayrecord"])
def test_empty_source_is_an_error(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("\n\n")
    else:
        write_records(path, [])
    with pytest.raises(ValueError, match=f"data source {path} holds no records"):
        Records(str(path))


def test_source_config_validates():
    with pytest.raises(ValueError, match="format='chat'"):
        SourceConfig("a.jsonl", format="chat")
    with pytest.raises(ValueError, match="weight must be positive"):
        SourceConfig("a.jsonl", weight=0)
