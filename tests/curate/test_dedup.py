"""Dedup: planted exact and near duplicates (their true shingle Jaccard computed here) are found
at the documented threshold, the earliest record represents its cluster, and signatures
estimate Jaccard as well as datasketch's."""

import json

import numpy as np
import pytest

from posttrain.curate import _chunks
from posttrain.curate._dedup import DedupConfig, dedup, lsh_params, minhash_signatures
from posttrain.curate._shingles import normalize
from tests.data.conftest import write_records

VOCAB = [f"w{i}" for i in range(3000)]
SHINGLE = 5


def _shingles(words):
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def _jaccard(a, b):
    sa, sb = _shingles(a), _shingles(b)
    return len(sa & sb) / len(sa | sb)


def _mutate(rng, words, k):
    """`words` with `k` random positions replaced by words from outside the vocabulary."""
    out = list(words)
    for p in rng.choice(len(words), k, replace=False):
        out[p] = f"x{rng.integers(10**6)}"
    return out


def _restyle(rng, words):
    """The same text after normalisation: random whitespace, case and fullwidth letters."""
    out = []
    for w in words:
        style = rng.integers(4)
        w = w.upper() if style == 1 else w.replace("w", "\uff37") if style == 2 else w
        out.append(w + str(rng.choice([" ", "  ", "\n", "\t "])))
    return " \n" + "".join(out)


def _corpus(tmp_path):
    """Two files of {"id", "text"} records: 80 random ~200-word documents, near copies at known
    Jaccard (above and clearly below 0.8) and restyled exact copies, one near copy placed
    before its original. Returns (files, id -> location, planted near pairs, exact pairs)."""
    rng = np.random.default_rng(1234)
    base = [list(rng.choice(VOCAB, int(rng.integers(180, 220)))) for _ in range(80)]
    first = {"id": "early", "words": _mutate(rng, base[5], 1)}
    a = [first] + [{"id": f"b{i}", "words": w} for i, w in enumerate(base)]
    copies, near, exact = [], [], []
    for i in range(40):  # 30 well above the threshold (1-2 words replaced), 10 clearly below
        k = [1, 2][i % 2] if i < 30 else [10, 14, 20][i % 3]
        words = _mutate(rng, base[10 + i], k)
        copies.append({"id": f"n{i}", "words": words})
        near.append((f"b{10 + i}", f"n{i}", _jaccard(base[10 + i], words)))
    for i in range(15):  # exact copies of base documents, and of 3 near copies
        src = copies[i] if i < 3 else {"id": f"b{60 + i}", "words": base[60 + i]}
        copies.append({"id": f"e{i}", "words": src["words"], "restyle": True})
        exact.append((src["id"], f"e{i}"))
    order = rng.permutation(len(copies))
    a += [copies[j] for j in order[:25]]
    b = [copies[j] for j in order[25:]]
    files, where = [], {}
    for name, part in (("a", a), ("b", b)):
        records = [
            {"id": r["id"], "text": _restyle(rng, r["words"]) if r.get("restyle") else
             " ".join(r["words"])}
            for r in part
        ]  # fmt: skip
        files.append(str(write_records(tmp_path / f"{name}.jsonl", records)))
        where.update({r["id"]: f"{files[-1]} line {n + 1}" for n, r in enumerate(part)})
    return files, where, near, exact


def _representatives(clusters_path):
    reps = {}
    for line in open(clusters_path):
        c = json.loads(line)
        assert c["size"] == 1 + len(c["exact"]) + len(c["near"])
        for member in c["exact"] + c["near"]:
            reps[member] = c["representative"]
    return reps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dedup")
    files, where, near, exact = _corpus(tmp)
    report = dedup(files, str(tmp / "out.jsonl"), clusters=str(tmp / "c.jsonl"), workers=1)
    return tmp, files, where, near, exact, report


def test_planted_near_duplicates_are_found_with_precision_and_recall_above_95(run):
    tmp, _, where, near, _, report = run
    assert report["params"]["threshold"] == 0.8
    positives = [(a, b) for a, b, j in near if j >= 0.87]
    negatives = [(a, b) for a, b, j in near if j <= 0.7]
    assert len(positives) == 30 and len(negatives) == 10  # the fixture plants what it says
    reps = _representatives(tmp / "c.jsonl")
    rep = lambda i: reps.get(where[i], where[i])  # noqa: E731
    found = {p for p in positives + negatives if rep(p[0]) == rep(p[1])}
    tp = len(found & set(positives))
    assert tp / len(positives) >= 0.95
    assert tp / max(len(found), 1) >= 0.95


def test_exact_copies_are_all_dropped_as_exact_and_counts_add_up(run):
    tmp, files, where, near, exact, report = run
    reps = _representatives(tmp / "c.jsonl")
    clusters = [json.loads(line) for line in open(tmp / "c.jsonl")]
    exact_members = {m for c in clusters for m in c["exact"]}
    for pair in exact:  # the later of the two is the exact copy (copies are shuffled)
        first, later = sorted((where[i] for i in pair), key=_position(files))
        assert later in exact_members
        assert reps[later] == reps.get(first, first)
    assert report["dropped_exact"] == len(exact) == 15
    records = sum(1 for f in files for _ in open(f))
    kept = [json.loads(line)["id"] for line in open(tmp / "out.jsonl")]
    assert report["records"] == records and report["kept"] == len(kept)
    assert report["kept"] + report["dropped_exact"] + report["dropped_near"] == records
    assert len(reps) == records - len(kept)  # every dropped record is in a cluster
    assert report["clusters"] == len(clusters)
    order = {loc: n for n, loc in enumerate(sorted(where.values(), key=_position(files)))}
    assert [order[where[i]] for i in kept] == sorted(order[where[i]] for i in kept)


def _position(files):
    return lambda loc: (files.index(loc.rsplit(" line ", 1)[0]), int(loc.rsplit(" ", 1)[1]))


def test_the_earliest_record_represents_its_cluster(run):
    tmp, files, where, *_ = run
    key = _position(files)
    for line in open(tmp / "c.jsonl"):
        c = json.loads(line)
        assert all(key(c["representative"]) < key(m) for m in c["exact"] + c["near"])
    reps = _representatives(tmp / "c.jsonl")
    assert reps[where["b5"]] == where["early"]  # the near copy came first in the input


@pytest.mark.slow  # two spawned workers import posttrain.data (jax): ~3-8 s
def test_output_is_identical_with_one_and_two_workers(run, tmp_path, monkeypatch):
    _, files, _, _, _, report = run
    monkeypatch.setattr(_chunks, "CHUNK", 16)  # several chunks per file, two files
    monkeypatch.setattr(_chunks, "POOL_START_S", 0.0)  # (workers start for any input)
    one = dedup(files, str(tmp_path / "1.jsonl"), clusters=str(tmp_path / "c1.jsonl"), workers=1)
    two = dedup(files, str(tmp_path / "2.jsonl"), clusters=str(tmp_path / "c2.jsonl"), workers=2)
    assert (tmp_path / "1.jsonl").read_bytes() == (tmp_path / "2.jsonl").read_bytes()
    assert (tmp_path / "c1.jsonl").read_bytes() == (tmp_path / "c2.jsonl").read_bytes()
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "records_per_s", "out")}  # noqa: E731
    assert strip(one) == strip(two) == strip(report)


def test_signatures_estimate_jaccard_within_four_standard_errors_like_datasketch():
    datasketch = pytest.importorskip("datasketch")
    rng = np.random.default_rng(7)
    num_perm, ours, theirs, truth = 128, [], [], []
    for k in [2, 5, 10, 20, 40, 60] * 6:
        a = list(rng.choice(VOCAB, 200))
        b = _mutate(rng, a, k)
        sig = minhash_signatures([" ".join(a), " ".join(b)], num_perm=num_perm)
        ours.append(float(np.mean(sig[0] == sig[1])))
        m = [datasketch.MinHash(num_perm=num_perm, seed=len(truth)) for _ in range(2)]
        for h, words in zip(m, (a, b), strict=True):
            h.update_batch([" ".join(s).encode() for s in _shingles(words)])
        theirs.append(m[0].jaccard(m[1]))
        truth.append(_jaccard(a, b))
    ours, theirs, truth = map(np.array, (ours, theirs, truth))
    se = np.sqrt(truth * (1 - truth) / num_perm)
    assert np.all(np.abs(ours - truth) <= 4 * se + 1e-9)
    assert abs(np.mean(ours - truth)) <= 3 * np.sqrt(np.mean(se**2) / len(truth))  # unbiased
    assert np.mean(np.abs(ours - truth)) <= 1.5 * np.mean(np.abs(theirs - truth)) + 0.005


def test_a_texts_signature_does_not_depend_on_its_chunk_or_its_style():
    rng = np.random.default_rng(3)
    texts = [" ".join(rng.choice(VOCAB, int(n))) for n in (3, 40, 0, 250, 1)]
    together = minhash_signatures(texts)
    alone = np.concatenate([minhash_signatures([t]) for t in texts])
    np.testing.assert_array_equal(together, alone)
    restyled = minhash_signatures([_restyle(rng, t.split()) for t in texts])
    np.testing.assert_array_equal(restyled, together)
    assert normalize(" Ａb\tC  d\n") == "ab c d"
    assert np.all(together[2] == np.iinfo(np.uint32).max)  # no words: no shingle


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.9])
def test_banding_matches_datasketchs_optimum(threshold):
    lsh = pytest.importorskip("datasketch.lsh")
    assert lsh_params(threshold, 128) == lsh._optimal_param(threshold, 128, 0.5, 0.5)


def test_chat_records_compare_by_roles_and_contents(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi  THERE"}, {"role": "assistant",
            "content": "hello"}], "id": 1}  # fmt: skip
    same = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant",
            "content": "Hello "}], "id": 2}  # fmt: skip
    roles = {"messages": [{"role": "system", "content": "hi there"}, {"role": "assistant",
             "content": "hello"}], "id": 3}  # fmt: skip
    pc = {"prompt": "hi there", "completion": "hello", "id": 4}
    path = write_records(tmp_path / "c.jsonl", [chat, same, roles, pc, dict(pc, id=5)])
    report = dedup([str(path)], str(tmp_path / "o.jsonl"), DedupConfig(near=False), workers=1)
    kept = [json.loads(line)["id"] for line in open(tmp_path / "o.jsonl")]
    assert kept == [1, 3, 4] and report["dropped_exact"] == 2 and report["dropped_near"] == 0


def test_cli_writes_the_report_and_rejects_bad_flags(run, tmp_path):
    from posttrain.cli.data_dedup import main
    from posttrain.errors import UserError

    _, files, _, _, _, report = run
    out, rep = tmp_path / "o.parquet", tmp_path / "r.json"
    argv = ["posttrain data dedup", *(f"--input={f}" for f in files), f"--out={out}"]
    assert main([*argv, f"--report={rep}", "--workers=1"]) == 0
    got = json.loads(rep.read_text())
    assert (got["kept"], got["dropped_near"]) == (report["kept"], report["dropped_near"])
    assert out.exists()
    with pytest.raises(UserError, match="o.parquet exists; pass --overwrite"):
        main(argv)
    with pytest.raises(UserError, match="bands=4 rows=0"):
        main([*argv, "--bands=4", "--overwrite"])
    with pytest.raises(UserError, match="required"):
        main(["posttrain data dedup", f"--out={out}"])


def test_a_malformed_record_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: expected a JSON object"):
        dedup([str(path)], str(tmp_path / "o.jsonl"), workers=1)
    assert not (tmp_path / "o.jsonl").exists()


def test_copies_across_parquet_and_arrayrecord_sources_are_exact_duplicates(tmp_path):
    records = [{"text": f"record number {i} " * 3, "id": i} for i in range(7)]
    pq = write_records(tmp_path / "a.parquet", records)  # row groups of 3
    ar = write_records(tmp_path / "b.arrayrecord", [dict(r, id=r["id"] + 10) for r in records])
    out = tmp_path / "o.arrayrecord"
    report = dedup([str(pq), str(ar)], str(out), workers=1)
    assert (report["kept"], report["dropped_exact"], report["clusters"]) == (7, 7, 7)
    assert report["largest_clusters"][0] == {
        "representative": f"{pq} row 0",
        "size": 2,
        "members": [f"{ar} record 0"],
    }
