"""The SFT pipeline: batch format, packing, masks, mixtures, sharding, resume and bad data."""

import collections
import dataclasses
import hashlib
import json

import numpy as np
import pytest

from posttrain.data import DataConfig, SourceConfig, make_pipeline
from posttrain.data._accounting import find_tally, source_names
from tests.data.conftest import write_records

KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids", "domain_ids")
WORDS = "the sea is wide and the wind is free the waves come rolling in to me".split()


def _texts(prefix, n):
    """n distinct texts of varied length (1 to 9 words)."""
    return [f"{prefix} {i} " + " ".join(WORDS[: (i * 7) % 9]) for i in range(n)]


def _config(*sources, **kwargs):
    sources = [s if isinstance(s, SourceConfig) else SourceConfig(str(s)) for s in sources]
    return DataConfig(sources=tuple(sources), **{"max_len": 32, "batch_size": 4, **kwargs})


def _pipeline(config, tok, **kwargs):
    return make_pipeline(config, tok, **{"process_index": 0, "process_count": 1, **kwargs})


def _documents(batches):
    """Each packed document's arrays, cut out of the rows by segment id."""
    for batch in batches:
        for r in range(len(batch["tokens"])):
            seg = batch["segment_ids"][r]
            for s in np.unique(seg[seg > 0]):
                yield {k: batch[k][r][seg == s] for k in KEYS}


def _check_row(row, pad_id):
    """A packed row: documents one after another from position 0, then padding."""
    seg, pos = row["segment_ids"], row["positions"]
    n = int((seg > 0).sum())
    assert (seg[:n] > 0).all() and (seg[n:] == 0).all()
    starts = np.flatnonzero(np.diff(seg[:n], prepend=0))
    np.testing.assert_array_equal(seg[starts], np.arange(1, len(starts) + 1))
    for start, end in zip(starts, [*starts[1:], n], strict=True):
        np.testing.assert_array_equal(pos[start:end], np.arange(end - start))
        np.testing.assert_array_equal(
            row["targets"][start : end - 1], row["tokens"][start + 1 : end]
        )
        # No target crosses into the next document.
        assert row["targets"][end - 1] == 0 and row["loss_mask"][end - 1] == 0
        assert len(set(row["domain_ids"][start:end])) == 1
    assert set(np.unique(row["loss_mask"])) <= {0.0, 1.0}
    pad = slice(n, None)
    assert (row["tokens"][pad] == pad_id).all() and (row["domain_ids"][pad] == -1).all()
    for k in ("targets", "loss_mask", "positions"):
        assert (row[k][pad] == 0).all()


def _take(data, n):
    return [next(data) for _ in range(n)]


def _text_of(tok, doc):
    return tok.decode(doc["tokens"].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("packing", [True, False])
def test_batch_format_and_row_invariants(tmp_path, chatml, packing):
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in _texts("doc", 30)])
    data = _pipeline(_config(path, batch_size=4, max_len=24, packing=packing), chatml)
    batches = _take(data, 6)
    for batch in batches:
        assert set(batch) == set(KEYS)
        for k, v in batch.items():
            assert v.shape == (4, 24), k
            assert v.dtype == (np.float32 if k == "loss_mask" else np.int32), k
        for r in range(4):
            _check_row({k: v[r] for k, v in batch.items()}, chatml.pad_id)
    most = max(b["segment_ids"].max() for b in batches)
    assert most > 1 if packing else most == 1


def test_loss_masks_for_each_format_and_file_type(tmp_path, chatml):
    n = 5
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": f"Answer {i}."},
            ]
        }
        for i in range(n)
    ]
    pairs = [{"prompt": f"Prompt {i}:", "completion": f" completion {i}"} for i in range(n)]
    texts = _texts("text", n)
    sources = (
        SourceConfig(str(write_records(tmp_path / "c.jsonl", chats)), domain="chat"),
        SourceConfig(str(write_records(tmp_path / "p.parquet", pairs)), domain="pc"),
        SourceConfig(str(write_records(tmp_path / "t.arrayrecord", [{"text": t} for t in texts]))),
    )
    config = _config(*sources, max_len=64, batch_size=2, num_epochs=1, shuffle=False)
    data = _pipeline(config, chatml)
    trained = collections.defaultdict(list)
    for doc in _documents(data):
        domain = data.domains[doc["domain_ids"][0]]
        targets = doc["targets"][doc["loss_mask"] == 1].tolist()
        trained[domain].append(chatml.decode(targets, skip_special_tokens=False))
        if domain == "default":  # text: every next token is trained; EOS ends the document
            assert doc["loss_mask"].tolist() == [1] * (len(doc["tokens"]) - 1) + [0]
            assert doc["tokens"][-1] == chatml.eos_id
            trained["text"].append(_text_of(chatml, doc))
    assert sorted(trained["chat"]) == [f"Answer {i}.<|im_end|>" for i in range(n)]
    assert sorted(trained["pc"]) == [f" completion {i}<|im_end|>" for i in range(n)]
    assert sorted(trained["text"]) == sorted(texts)
    assert data.stats["truncated"] == 0 and data.stats["used"] == 3 * n


def test_packed_documents_are_the_unpacked_ones(tmp_path, chatml):
    texts = _texts("doc", 40)
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    config = _config(path, max_len=32, batch_size=4, num_epochs=1, shuffle=False)
    batches = list(_pipeline(config, chatml))
    for batch in batches:
        for r in range(4):
            _check_row({k: v[r] for k, v in batch.items()}, chatml.pad_id)
    docs = sorted(tuple(d["tokens"].tolist()) for d in _documents(batches))
    expected = sorted(tuple(chatml.encode(t) + [chatml.eos_id]) for t in texts)
    assert docs == expected
    assert 4 * len(batches) < len(texts)  # several documents share rows


def test_finite_stream_pads_its_last_batch(tmp_path, chatml):
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in _texts("doc", 5)])
    config = _config(path, batch_size=4, packing=False, num_epochs=2)
    batches = list(_pipeline(config, chatml))
    assert len(batches) == 3  # 10 examples, one per row
    assert (batches[-1]["segment_ids"][2:] == 0).all() and batches[-1]["segment_ids"][1, 0] == 1
    counts = collections.Counter(_text_of(chatml, d) for d in _documents(batches))
    assert set(counts.values()) == {2} and len(counts) == 5


def test_same_seed_same_batches(tmp_path, chatml):
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in _texts("doc", 30)])
    a, b = (_take(_pipeline(_config(path), chatml), 5) for _ in range(2))
    other = _take(_pipeline(_config(path, seed=1), chatml), 5)
    for x, y in zip(a, b, strict=True):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert any((x["tokens"] != y["tokens"]).any() for x, y in zip(a, other, strict=True))


def test_each_epoch_is_reshuffled(tmp_path, chatml):
    texts = _texts("doc", 10)
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = _pipeline(_config(path, batch_size=5, packing=False), chatml)
    order = [_text_of(chatml, d) for d in _documents(_take(data, 4))]
    first, second = order[:10], order[10:]
    assert sorted(first) == sorted(second) == sorted(texts)
    assert first != second and first != texts


def test_resume_reproduces_the_next_batches_and_stats(tmp_path, chatml):
    good = [{"text": t} for t in _texts("a", 17)]
    a = write_records(tmp_path / "a.jsonl", good[:5] + ["{bad json"] + good[5:])
    b = write_records(tmp_path / "b.parquet", [{"text": t} for t in _texts("b", 9)])
    config = _config(
        SourceConfig(str(a), weight=2.0, domain="a"),
        SourceConfig(str(b), domain="b"),
        max_len=12,
        on_error="skip",
    )
    data = _pipeline(config, chatml)
    _take(data, 3)
    state = json.loads(json.dumps(data.get_state()))
    stats = data.stats
    expected, expected_stats = _take(data, 4), data.stats

    resumed = _pipeline(config, chatml)
    resumed.set_state(state)
    assert resumed.stats == stats
    for x, y in zip(expected, _take(resumed, 4), strict=True):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert resumed.stats == expected_stats
    assert expected_stats["skipped"] >= 1 and expected_stats["truncated"] >= 1
    per_source = expected_stats["sources"]
    assert per_source["a"]["skipped"] == expected_stats["skipped"]  # the bad record is a's
    assert sum(c["read"] for c in per_source.values()) == expected_stats["read"]

    del find_tally(state)["sources"]  # a state saved before per-source counts: they restart
    legacy = _pipeline(config, chatml)
    legacy.set_state(state)
    assert legacy.stats["read"] == stats["read"]
    assert all(c["read"] == 0 for c in legacy.stats["sources"].values())

    other = _pipeline(_config(*config.sources, max_len=12, on_error="skip", seed=3), chatml)
    with pytest.raises(ValueError, match=r"different pipeline \(differs in \['seed'\]\)"):
        other.set_state(state)


def test_mixture_follows_weights_and_tags_domains(tmp_path, chatml):
    a = write_records(tmp_path / "a.jsonl", [{"text": t} for t in _texts("alpha", 40)])
    b = write_records(tmp_path / "b.arrayrecord", [{"text": t} for t in _texts("beta", 40)])
    config = _config(
        SourceConfig(str(a), weight=3.0, domain="a"),
        SourceConfig(str(b), weight=1.0, domain="b"),
    )
    data = _pipeline(config, chatml)
    assert data.domains == ("a", "b")
    counts = collections.Counter()
    for doc in _documents(_take(data, 30)):
        domain = data.domains[doc["domain_ids"][0]]
        assert _text_of(chatml, doc).startswith("alpha" if domain == "a" else "beta")
        counts[domain] += 1
    assert 0.7 < counts["a"] / (counts["a"] + counts["b"]) < 0.8, counts
    assert data.stats["domains"] == dict(counts)  # stats count exactly the batches' documents


def test_processes_read_disjoint_shares_of_the_records(tmp_path, chatml):
    texts = _texts("doc", 11)
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    config = _config(path, batch_size=4, num_epochs=1, shuffle=False)
    seen = []
    for index in range(2):
        data = _pipeline(config, chatml, process_index=index, process_count=2)
        batches = list(data)
        assert data.rows == 2 and all(b["tokens"].shape == (2, 32) for b in batches)
        seen.append([_text_of(chatml, d) for d in _documents(batches)])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(texts)
    with pytest.raises(ValueError, match="batch_size 3 does not divide over 2 processes"):
        _pipeline(_config(path, batch_size=3), chatml, process_index=0, process_count=2)


def test_split_by_rows_feeds_each_process_its_rows_of_one_process_batches(tmp_path, chatml):
    """`split_by="rows"`: each of 2 processes packs the global batch and yields its half of the
    rows; side by side they are one process's batches, packed and shuffled (records of several
    lengths, 3 epochs), which a split of the records does not give."""
    texts = [" ".join(["w"] * (1 + i % 7)) + f" {i}" for i in range(23)]
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    config = _config(path, batch_size=4, num_epochs=3, split_by="rows")
    one = list(_pipeline(config, chatml))
    halves = [list(_pipeline(config, chatml, process_index=i, process_count=2)) for i in (0, 1)]
    assert len(one) == len(halves[0]) == len(halves[1]) > 3
    for whole, a, b in zip(one, *halves, strict=True):
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([a[key], b[key]]), whole[key])
    records = dataclasses.replace(config, split_by="records")
    split = [list(_pipeline(records, chatml, process_index=i, process_count=2)) for i in (0, 1)]
    glued = [np.concatenate([a["tokens"], b["tokens"]]) for a, b in zip(*split, strict=False)]
    assert [len(s) for s in split] != [len(one)] * 2 or not all(
        np.array_equal(g, w["tokens"]) for g, w in zip(glued, one, strict=True)
    )
    with pytest.raises(ValueError, match="split_by='pages': records|rows"):
        _config(path, split_by="pages")


def test_malformed_records_name_file_and_line(tmp_path, chatml):
    path = write_records(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": "ok"}, '{"text": '])
    data = _pipeline(_config(path, num_epochs=1, shuffle=False), chatml)
    with pytest.raises(ValueError, match=rf"{path} line 3: invalid JSON"):
        list(data)
    path = write_records(tmp_path / "keys.jsonl", [{"text": "ok"}, {"txt": "ok"}])
    with pytest.raises(ValueError, match=rf"{path} line 2: record has keys \['txt'\]"):
        list(_pipeline(_config(path, num_epochs=1, shuffle=False), chatml))
    rows = [{"text": "ok"}] * 4 + [{"prompt": "p", "completion": 3}]
    path = write_records(tmp_path / "types.parquet", rows)
    with pytest.raises(ValueError, match=rf"{path} row 4: 'completion' must be a string"):
        list(_pipeline(_config(path, num_epochs=1, shuffle=False), chatml))


def test_skipped_records_are_counted(tmp_path, chatml):
    records = [{"text": t} for t in _texts("doc", 6)]
    path = write_records(tmp_path / "t.jsonl", records[:2] + ["not json", {"x": 1}] + records[2:])
    data = _pipeline(_config(path, num_epochs=1, on_error="skip"), chatml)
    docs = [_text_of(chatml, d) for d in _documents(data)]
    assert sorted(docs) == sorted(r["text"] for r in records)
    assert data.stats == {
        "read": 8,
        "used": 6,
        "skipped": 2,
        "truncated": 0,
        "dropped": 0,
        "no_loss": 0,
        "domains": {"default": 6},
        "sources": {
            "t": {"read": 8, "used": 6, "skipped": 2, "truncated": 0, "dropped": 0, "no_loss": 0}
        },
    }


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_examples_are_truncated_or_dropped(tmp_path, chatml, overlong):
    long = " ".join(WORDS * 2)
    texts = ["short one", long, "short two", long]
    path = write_records(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    config = _config(path, max_len=12, num_epochs=1, shuffle=False, overlong=overlong)
    data = _pipeline(config, chatml)
    docs = [d["tokens"].tolist() for d in _documents(data)]
    full = chatml.encode(long) + [chatml.eos_id]
    assert len(full) > 12
    if overlong == "truncate":
        assert docs.count(full[:12]) == 2 and data.stats["truncated"] == 2
    else:
        assert len(docs) == 2 and data.stats["dropped"] == 2 and data.stats["truncated"] == 0


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_each_source_counts_and_reports_what_it_cut_or_left_out(tmp_path, chatml, caplog, overlong):
    long = {"text": " ".join(WORDS * 2)}
    short = [{"text": "short one"}, {"text": "short two"}, {"text": "short three"}]
    a = write_records(tmp_path / "a.jsonl", [long, *short[:2], "{bad json", long, short[2]])
    b = write_records(tmp_path / "sub" / "b.parquet", [short[0], long, short[1]])
    config = _config(
        a, b, max_len=12, num_epochs=2, shuffle=False, on_error="skip", overlong=overlong
    )
    with caplog.at_level("INFO", logger="posttrain.data"):
        data = _pipeline(config, chatml)
        assert data.source_names == ("a", "b")
        batches = list(data)
        data.log_stats()

    # Two epochs of a (6 records: 2 long, 1 malformed) and of b (3 records: 1 long).
    cut = "truncated" if overlong == "truncate" else "dropped"
    kept = 1 if overlong == "truncate" else 0
    zero = dict.fromkeys(("skipped", "truncated", "dropped", "no_loss"), 0)
    expected = {
        "a": {**zero, "read": 12, "used": 6 + 4 * kept, "skipped": 2, cut: 4},
        "b": {**zero, "read": 6, "used": 4 + 2 * kept, cut: 2},
    }
    stats = data.stats
    assert stats["sources"] == expected
    for key in ("read", "used", "skipped", "truncated", "dropped", "no_loss"):
        assert stats[key] == expected["a"][key] + expected["b"][key]
    assert len(list(_documents(batches))) == stats["used"]
    assert data.batch_metrics() == {
        "data/truncated": 6.0 * kept,
        "data/dropped": 6.0 * (1 - kept),
        "data/skipped": 2.0,
        "data/no_loss": 0.0,
        f"data/a/{cut}": 4.0,
        "data/a/skipped": 2.0,
        f"data/b/{cut}": 2.0,
    }

    how = (
        "truncated to max_len=12" if kept else "dropped as longer than max_len=12 (overlong='drop')"
    )
    bad = "skipped as malformed (on_error='skip')"
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "data source" in r.message]
    b_level = "INFO" if kept else "WARNING"  # truncation alone is not a warning
    assert lines == [
        ("WARNING", f"data source {a}, after epoch 1: 2 of 6 records {how}, 1 {bad}"),
        (b_level, f"data source {b}, after epoch 1: 1 of 3 records {how}"),
        ("WARNING", f"data source {a}, after epoch 2: 4 of 12 records {how}, 2 {bad}"),
        (b_level, f"data source {b}, after epoch 2: 2 of 6 records {how}"),
        ("WARNING", f"data source {a}, at the end of the run: 4 of 12 records {how}, 2 {bad}"),
        (b_level, f"data source {b}, at the end of the run: 2 of 6 records {how}"),
    ]


def test_source_names_are_file_names_made_unique():
    paths = ["d/train.jsonl", "gs://b/x/train.jsonl", "d/math/*.parquet", "d/web-[0-9].jsonl"]
    assert source_names(paths) == ["train_0", "train_1", "math", "web"]
    assert source_names(["chat v2.jsonl", "**/*.jsonl"]) == ["chat_v2", "source"]


@pytest.mark.parametrize("num_epochs", [None, 1])
def test_everything_filtered_is_an_error_not_a_hang(tmp_path, chatml, num_epochs):
    path = write_records(tmp_path / "t.jsonl", ["nope"] * 5)
    data = _pipeline(_config(path, num_epochs=num_epochs, on_error="skip"), chatml)
    with pytest.raises(
        ValueError, match=r"yields no example.*Last skipped: .*t.jsonl line \d: invalid JSON"
    ):
        next(data)


def test_missing_or_empty_sources_fail_at_construction(tmp_path, chatml):
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        _pipeline(_config(tmp_path / "missing.jsonl"), chatml)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        _pipeline(_config(tmp_path / "*.jsonl"), chatml)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty.jsonl holds no records"):
        _pipeline(_config(tmp_path / "empty.jsonl"), chatml)
    with pytest.raises(ValueError, match="on_error='ignore'"):
        _config(tmp_path / "empty.jsonl", on_error="ignore")


def test_manifest_identifies_data_config_and_tokenizer(tmp_path, chatml, chatml_dir):
    a = write_records(tmp_path / "d" / "a.jsonl", [{"text": "one"}, {"text": "two"}])
    b = write_records(tmp_path / "d" / "b.jsonl", [{"text": "three"}])
    c = write_records(tmp_path / "c.parquet", [{"text": "four"}])
    config = _config(SourceConfig(str(tmp_path / "d" / "*.jsonl"), weight=2, domain="x"), c)
    data = _pipeline(config, chatml)
    path = data.write_manifest(tmp_path / "out" / "manifest.json")
    manifest = json.loads(path.read_text())
    assert manifest == data.manifest()

    def sha(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    first, second = manifest["sources"]
    assert (first["records"], first["domain"], first["weight"]) == (3, "x", 2)
    assert [(f["path"], f["sha256"], f["records"]) for f in first["files"]] == [
        (str(a), sha(a), 2),
        (str(b), sha(b), 1),
    ]
    assert second["files"] == [{"path": str(c), "sha256": sha(c), "records": 1}]
    assert manifest["config"]["max_len"] == 32 and manifest["config"]["seed"] == 0
    assert manifest["tokenizer"]["sha256"] == sha(chatml_dir / "tokenizer.json")


def test_defaults_to_this_jax_process_and_loads_a_tokenizer_dir(tmp_path, chatml_dir):
    path = write_records(tmp_path / "t.jsonl", [{"text": "hello there"}])
    data = make_pipeline(_config(path, batch_size=2, num_epochs=1), str(chatml_dir))
    assert (data.process_index, data.process_count, data.rows) == (0, 1, 2)
    assert [b["segment_ids"].max() for b in data] == [1]
