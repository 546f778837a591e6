"""Decontamination: training records holding a 13-word run of an eval item (restyled) are
dropped and reported per eval item; 12-word runs and runs across two fields are kept."""

import json

import numpy as np
import pytest

from posttrain.curate._decontam import DecontamConfig, decontaminate
from tests.data.conftest import write_records


def _words(rng, prefix, n):
    return [f"{prefix}{i}" for i in rng.integers(0, 5000, n)]


@pytest.fixture
def data(tmp_path):
    """Five eval items ({"question", "answer"}) and 40 training records of random words, some
    with planted runs of eval words; returns (train path, eval path, eval items)."""
    rng = np.random.default_rng(0)
    items = [{"question": " ".join(_words(rng, "q", 30)), "answer": " ".join(_words(rng, "a", 20)),
              "id": k} for k in range(5)]  # fmt: skip
    train = [{"text": " ".join(_words(rng, "t", 150)), "id": i} for i in range(40)]

    def plant(i, run, field="text"):
        words = train[i][field].split()
        words[60:60] = run
        train[i][field] = " ".join(words)

    q = [item["question"].split() for item in items]
    a = [item["answer"].split() for item in items]
    plant(3, [w.upper() + "," for w in q[0][5:18]])  # 13 words, restyled: still a match
    plant(10, q[0][0:13])
    plant(20, a[2][4:17])
    train[25] = {"id": 25, "messages": [
        {"role": "user", "content": "what is it?"},
        {"role": "assistant", "content": "Well: " + " ".join(q[2][10:23]) + "."}]}  # fmt: skip
    plant(30, q[4][0:12])  # 12 words: not a 13-gram
    plant(31, q[1][-6:] + a[1][:7])  # 13 words across question and answer: no single field
    plant(35, q[3][0:13] + ["z"] + q[3][14:27])  # two distinct 13-grams of item 3
    train_path = write_records(tmp_path / "train.jsonl", train)
    eval_path = write_records(tmp_path / "eval.jsonl", items)
    return train_path, eval_path, train


def test_planted_13_grams_are_removed_and_reported_per_eval_item(data, tmp_path):
    train_path, eval_path, train = data
    out = tmp_path / "out.jsonl"
    report = decontaminate([str(train_path)], str(out), [str(eval_path)], workers=1)
    dropped = {3, 10, 20, 25, 35}
    kept = [json.loads(line) for line in open(out)]
    assert kept == [r for i, r in enumerate(train) if i not in dropped]
    assert (report["records"], report["kept"], report["dropped"]) == (40, 35, 5)
    line = lambda i: f"{eval_path} line {i + 1}"  # noqa: E731
    assert report["hits"] == [
        {"location": line(0), "records": 2},
        {"location": line(2), "records": 2},
        {"location": line(3), "records": 1},
    ]
    assert report["eval_items_hit"] == 3 and report["eval_items_without_ngrams"] == 0
    got = {d["location"]: (d["ngrams"], d["eval_items"]) for d in report["dropped_records"]}
    assert got == {
        f"{train_path} line 4": (1, [line(0)]),
        f"{train_path} line 11": (1, [line(0)]),
        f"{train_path} line 21": (1, [line(2)]),
        f"{train_path} line 26": (1, [line(2)]),
        f"{train_path} line 36": (2, [line(3)]),
    }


def test_min_count_keeps_records_sharing_fewer_ngrams(data, tmp_path):
    train_path, eval_path, train = data
    out = tmp_path / "out.jsonl"
    report = decontaminate([str(train_path)], str(out), [str(eval_path)],
                           DecontamConfig(min_count=2), workers=1)  # fmt: skip
    assert report["dropped"] == 1 and report["sharing_below_min_count"] == 4
    assert report["dropped_records"][0]["location"] == f"{train_path} line 36"


def test_shorter_ngrams_and_text_eval_sets(data, tmp_path):
    train_path, _, train = data
    evals = tmp_path / "eval.txt"
    question = train[7]["text"].split()
    evals.write_text("\n" + " ".join(question[:8]) + "\nfar too short\n")
    out = tmp_path / "out.jsonl"
    report = decontaminate([str(train_path)], str(out), [str(evals)], DecontamConfig(ngram=8),
                           workers=1)  # fmt: skip
    assert report["hits"] == [{"location": f"{evals} line 2", "records": 1}]
    assert report["eval_items"] == 2 and report["eval_items_without_ngrams"] == 1
    assert [d["location"] for d in report["dropped_records"]] == [f"{train_path} line 8"]


@pytest.mark.slow  # two spawned workers import posttrain.data (jax): ~3-8 s
def test_two_workers_write_the_same_output(data, tmp_path, monkeypatch):
    from posttrain.curate import _chunks

    train_path, eval_path, _ = data
    monkeypatch.setattr(_chunks, "CHUNK", 7)
    monkeypatch.setattr(_chunks, "POOL_START_S", 0.0)  # (workers start for any input)
    reports = [
        decontaminate(
            [str(train_path)], str(tmp_path / f"{w}.jsonl"), [str(eval_path)], workers=w
        )  # fmt: skip
        for w in (1, 2)
    ]
    assert (tmp_path / "1.jsonl").read_bytes() == (tmp_path / "2.jsonl").read_bytes()
    for r in reports:
        del r["seconds"], r["out"]
    assert reports[0] == reports[1]


def test_cli_writes_the_report(data, tmp_path):
    from posttrain.cli.data_decontaminate import main
    from posttrain.errors import UserError

    train_path, eval_path, _ = data
    report = tmp_path / "r.json"
    argv = ["posttrain data decontaminate", f"--input={train_path}", f"--eval={eval_path}",
            f"--out={tmp_path / 'o.jsonl'}", f"--report={report}", "--workers=1"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(report.read_text())["dropped"] == 5
    with pytest.raises(UserError, match="o.jsonl exists; pass --overwrite"):
        main(argv)
    argv.append("--overwrite")
    with pytest.raises(UserError, match="ngram must be 1 to 64"):
        main([*argv, "--ngram=0"])
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        main([*argv[:2], f"--eval={tmp_path / 'missing.txt'}", *argv[3:]])
