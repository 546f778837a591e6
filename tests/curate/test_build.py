"""Versioned builds (posttrain/curate/_build.py): the same inputs give the same id and bytes, a
changed record changes the id and `diff` names it, a changed file is refused naming it, a build
already there is reused, and a build reads (and trains) as its raw sources do."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grain
import jax
import numpy as np
import pytest

from posttrain.cli.data_build import main as build_main
from posttrain.cli.data_diff import main as diff_main
from posttrain.curate import _build
from posttrain.curate._build import _unmatched, build, diff
from posttrain.data import DataConfig, Records, SourceConfig, make_pipeline
from posttrain.data import verify_build as verify
from posttrain.errors import UserError
from tests.data.conftest import write_records

SHARD = 8
WORDS = ["alpha", "beta", "gamma", "delta", "café", "東京", "sea", "wind", "four", "nine"]


def _chats(rng, n):
    return [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(WORDS, 5))},
                {"role": "assistant", "content": f"answer {i}: " + " ".join(rng.choice(WORDS, 3))},
            ]
        }
        for i in range(n)
    ]


def _write_inputs(folder, chats, texts):
    a = write_records(folder / "a.jsonl", chats)
    b = write_records(folder / "b.parquet", texts)  # row groups of 3
    return [str(a), str(b)]


@pytest.fixture
def inputs(tmp_path):
    """(source paths, chats, texts): 20 chats in JSON lines, 12 texts in Parquet."""
    rng = np.random.default_rng(0)
    chats = _chats(rng, 20)
    texts = [{"text": f"doc {i}: " + " ".join(rng.choice(WORDS, 4))} for i in range(12)]
    return _write_inputs(tmp_path / "in", chats, texts), chats, texts


def _canonical(record) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(record) -> str:
    return hashlib.sha256(_canonical(record)).digest()[:16].hex()


def _shards(build_dir) -> list[Path]:
    return sorted(Path(build_dir).glob("shard-*.arrayrecord"))


def _stored(build_dir) -> list[bytes]:
    """Every record's bytes, shard after shard, read with Grain (not the code under test)."""
    out = []
    for shard in _shards(build_dir):
        source = grain.sources.ArrayRecordDataSource([str(shard)])
        out += [source[i] for i in range(len(source))]
    return out


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_same_inputs_give_the_same_id_and_the_same_bytes(tmp_path, inputs):
    sources, chats, texts = inputs
    x = build(sources, str(tmp_path / "x"), shard_records=SHARD, progress=False)
    y = build(sources, str(tmp_path / "y"), shard_records=SHARD, progress=False)
    assert x.id == y.id == os.path.basename(x.path) and not x.reused and not y.reused
    names = sorted(os.listdir(x.path))
    shards = [f"shard-{i:05d}.arrayrecord" for i in range(4)]  # 32 records, 8 per shard
    assert names == sorted(os.listdir(y.path)) == ["manifest.json", "record_hashes.bin", *shards]
    for name in names:
        assert Path(x.path, name).read_bytes() == Path(y.path, name).read_bytes(), name

    records = chats + texts
    assert _stored(x.path) == [_canonical(r) for r in records]
    hashes = Path(x.path, "record_hashes.bin").read_bytes()
    assert hashes.hex() == "".join(_digest(r) for r in records)
    m = x.manifest
    assert [s["records"] for s in m["shards"]] == [8, 8, 8, 8]
    assert [s["sha256"] for s in m["shards"]] == [_sha(p) for p in _shards(x.path)]
    assert m["counts"] == {"records": 32, "shards": 4}
    assert [(s["pattern"], s["records"]) for s in m["sources"]] == [
        (sources[0], 20),
        (sources[1], 12),
    ]
    assert [f["sha256"] for s in m["sources"] for f in s["files"]] == [_sha(p) for p in sources]


def test_building_again_reuses_the_build_and_a_changed_file_is_refused(
    tmp_path, inputs, monkeypatch
):
    sources, chats, _ = inputs
    out = str(tmp_path / "builds")
    first = build(sources, out, shard_records=SHARD, progress=False)
    shard = Path(first.path, "shard-00002.arrayrecord")
    written = shard.stat().st_mtime_ns
    with monkeypatch.context() as patch:  # the same files again: found, nothing written
        patch.setattr(_build, "_write", lambda *args: pytest.fail("wrote the build again"))
        again = build(sources, out, shard_records=SHARD, progress=False)
    assert again.reused and again.id == first.id and again.manifest == first.manifest
    # The same records in other bytes (compact JSON): written to staging, which finds the id.
    shutil.copytree(tmp_path / "in", tmp_path / "copy")
    copies = [str(tmp_path / "copy" / Path(s).name) for s in sources]
    lines = [json.dumps(r, separators=(",", ":")) for r in chats]
    Path(copies[0]).write_text("\n".join(lines) + "\n")
    assert _sha(copies[0]) != _sha(sources[0])
    elsewhere = build(copies, out, shard_records=SHARD, progress=False)
    assert elsewhere.reused and elsewhere.id == first.id and elsewhere.manifest == first.manifest
    assert shard.stat().st_mtime_ns == written and os.listdir(out) == [first.id]
    assert verify(first.path)["id"] == first.id

    original = shard.read_bytes()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 1
    shard.write_bytes(bytes(tampered))
    refused = r"shard-00002.arrayrecord no longer matches manifest.json"
    with pytest.raises(ValueError, match=refused):
        verify(first.path)
    with pytest.raises(ValueError, match=refused):
        build(sources, out, shard_records=SHARD, progress=False)
    with pytest.raises(ValueError, match=refused):  # what a training run reads it through
        Records(first.path)

    shard.write_bytes(original)
    manifest_path = Path(first.path, "manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest["params"] = {"note": "edited"}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest.json: was edited"):
        verify(first.path)


def test_a_build_is_readable_under_the_umask_and_a_killed_builds_staging_is_cleared(
    tmp_path, inputs
):
    sources, _, _ = inputs
    out = tmp_path / "builds"
    out.mkdir()
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()  # a pid no process has: a killed build's
    (out / f".build-{process.pid}.k1ll3d").mkdir()
    (out / f".build-{process.pid}.k1ll3d" / "shard-00000.arrayrecord").write_bytes(b"part")
    old = os.umask(0o022)
    try:
        result = build(sources, str(out), shard_records=SHARD, progress=False)
    finally:
        os.umask(old)
    assert os.listdir(out) == [result.id]  # the staging of the killed build is gone
    assert Path(result.path).stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in Path(result.path).iterdir()} == {0o644}


def test_one_changed_record_changes_the_id_and_diff_names_it(tmp_path, inputs):
    sources, chats, _ = inputs
    out = str(tmp_path / "builds")
    a = build(sources, out, shard_records=SHARD, progress=False)
    old_file = _sha(sources[0])
    changed = json.loads(json.dumps(chats))
    changed[13]["messages"][1]["content"] = "a different answer"
    write_records(Path(sources[0]), changed)
    b = build(sources, out, shard_records=SHARD, progress=False)
    assert b.id != a.id
    differs = [
        p.read_bytes() != q.read_bytes()
        for p, q in zip(_shards(a.path), _shards(b.path), strict=True)
    ]
    assert differs == [False, True, False, False]  # record 13 is in shard 1

    d = diff(a.path, b.path)
    assert (d.removed, d.added) == (1, 1) and not d.same
    where = "shard-00001.arrayrecord record 5"
    assert [(c.hash, c.index, c.location) for c in d.removed_records] == [
        (_digest(chats[13]), 13, where)
    ]
    assert [(c.hash, c.index, c.location) for c in d.added_records] == [
        (_digest(changed[13]), 13, where)
    ]
    assert "assistant: a different answer" in d.added_records[0].preview
    assert d.sources == [
        {"change": "changed", "path": sources[0], "a": old_file, "b": _sha(sources[0])}
    ]
    assert d.params == [] and (d.a["records"], d.b["records"]) == (32, 32)
    assert diff(a.path, a.path).same


def test_params_enter_the_id_and_the_diff_but_not_the_shards(tmp_path, inputs):
    sources, _, _ = inputs
    x, y = (
        build(sources, str(tmp_path / "b"), shard_records=SHARD, progress=False,
              params={"dedup": {"threshold": t}, "note": "n"})
        for t in (0.8, 0.9)
    )  # fmt: skip
    assert x.id != y.id
    assert [p.read_bytes() for p in _shards(x.path)] == [p.read_bytes() for p in _shards(y.path)]
    d = diff(x.path, y.path)
    assert d.params == [{"key": "dedup.threshold", "a": 0.8, "b": 0.9}]
    assert (d.removed, d.added, d.sources) == (0, 0, [])


def test_records_are_diffed_as_multisets():
    def hashes(*values):
        return np.array([[v, 7] for v in values], dtype=np.uint64)

    removed, added = _unmatched(hashes(5, 7, 5, 9), hashes(7, 5, 3))
    assert removed.tolist() == [2, 3] and added.tolist() == [2]  # the second 5 and the 9; the 3
    removed, added = _unmatched(hashes(1, 2, 2), hashes(2, 1, 2))  # the same, reordered
    assert removed.tolist() == added.tolist() == []


def test_the_cli_builds_and_diffs(tmp_path, inputs, capsys):
    sources, _, _ = inputs
    out = str(tmp_path / "builds")
    report = tmp_path / "dedup_report.json"
    report.write_text(json.dumps({"removed": 3}))
    flags = [*(f"--input={s}" for s in sources), f"--out={out}", "--shard-records=8"]
    assert build_main(["posttrain data build", *flags, f"--params={report}", "--param=n=1"]) == 0
    text = capsys.readouterr().out
    first = build(sources, out, shard_records=8, params={"dedup_report": {"removed": 3}, "n": 1},
                  progress=False)  # fmt: skip
    assert first.reused and f"build {first.id}: written" in text and "32" in text
    assert build_main(["posttrain data build", *flags, "--param=n=two"]) == 0
    second = build(sources, out, shard_records=8, params={"n": "two"}, progress=False)
    assert second.reused and second.id in capsys.readouterr().out

    assert diff_main(["posttrain data diff", first.path, second.path]) == 0
    text = capsys.readouterr().out
    for expected in ("dedup_report.removed", "'two'", "0 removed (-), 0 added", first.id):
        assert expected in text
    with pytest.raises(UserError, match="--out=DIR are required"):
        build_main(["posttrain data build", f"--input={sources[0]}"])
    with pytest.raises(UserError, match="two build directories"):
        diff_main(["posttrain data diff", first.path])


def test_a_build_reads_and_batches_as_its_raw_source(tmp_path, inputs, chatml):
    sources, chats, texts = inputs
    whole = build(sources, str(tmp_path / "builds"), shard_records=SHARD, progress=False)
    records = Records(whole.path)
    assert [json.loads(records[i][0]) for i in range(len(records))] == chats + texts
    assert records.build == {"id": whole.id, "path": whole.path}

    one = build(sources[0], str(tmp_path / "builds"), shard_records=SHARD, progress=False)
    config = DataConfig(sources=(SourceConfig(sources[0]),), max_len=128, batch_size=4)
    on_build = DataConfig(sources=(SourceConfig(one.path),), max_len=128, batch_size=4)
    raw = make_pipeline(config, chatml, process_index=0, process_count=1)
    built = make_pipeline(on_build, chatml, process_index=0, process_count=1)
    for x, y in zip([next(raw) for _ in range(6)], [next(built) for _ in range(6)], strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert built.manifest()["sources"][0]["build"] == {"id": one.id, "path": one.path}
    assert "build" not in raw.manifest()["sources"][0]
    raw.close()
    built.close()

    Path(one.path, "shard-00001.arrayrecord").write_bytes(b"not the shard")
    with pytest.raises(ValueError, match="shard-00001.arrayrecord no longer matches"):
        make_pipeline(on_build, chatml, process_index=0, process_count=1)


def test_a_build_in_a_bucket(gcs_bucket, tmp_path, inputs):
    sources, chats, texts = inputs
    local = build(sources, str(tmp_path / "builds"), shard_records=SHARD, progress=False)
    remote = build(sources, f"{gcs_bucket}/builds", shard_records=SHARD, progress=False)
    assert remote.id == local.id and remote.path == f"{gcs_bucket}/builds/{local.id}"
    assert verify(remote.path)["id"] == local.id
    records = Records(remote.path)
    assert [json.loads(records[i][0]) for i in range(len(records))] == chats + texts
    assert build(sources, f"{gcs_bucket}/builds", shard_records=SHARD, progress=False).reused
    assert diff(local.path, remote.path).same


@pytest.mark.slow  # ~85 s on 2 cores: three 8-step runs of the tiny SFT config
def test_sft_on_a_build_resumes_bitwise_as_on_its_raw_source(tmp_path, devices):
    from posttrain.methods import run_from_config
    from tests.train.conftest import small_config

    raw = small_config(train__steps=8, checkpoint__every=4)
    made = build([raw.data.sources[0].path], str(tmp_path / "builds"), progress=False)
    on_build = small_config(train__steps=8, checkpoint__every=4)
    on_build.data.sources[0].path = made.path
    straight = run_from_config(raw, str(tmp_path / "raw"))
    built = run_from_config(on_build, str(tmp_path / "built"))
    shutil.copytree(tmp_path / "built", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
    steps = []
    resumed = run_from_config(on_build, str(tmp_path / "resumed"),
                              on_metrics=lambda step, metrics: steps.append(step))  # fmt: skip
    assert steps == [5, 6, 7, 8]
    for run in (built, resumed):
        for x, y in zip(jax.tree.leaves(straight["state"].params),
                        jax.tree.leaves(run["state"].params), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    manifest = json.loads((tmp_path / "built" / "manifest.json").read_text())
    assert manifest["sources"][0]["build"]["id"] == made.id
