"""Difficulty buckets: records split by a pass rate (or any score) into files a curriculum
(`data.curriculum`, `_curriculum.py`) can schedule, hardest first.

`stratify` buckets keys by pass rate (quantiles or fixed edges); `stratify_records` does it for
a record file, reading each record's score from a field or from a {record index: pass rate}
map (an RL run's `difficulty.json` has one), and writes one file per bucket.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.data import Records, RecordWriter, kind_of, read_records


def stratify(
    pass_rates: Mapping[Hashable, float],
    *,
    num_buckets: int = 3,
    edges: Sequence[float] | None = None,
) -> list[list[Hashable]]:
    """Buckets prompts by estimated difficulty, hardest (lowest pass rate) first.

    By default the buckets are quantiles: prompts sorted by pass rate (ties in input order) and
    split into `num_buckets` near-equal parts. With `edges`, bucket i holds the rates in
    [edges[i-1], edges[i]) instead, e.g. edges=(0.2, 0.8) -> hard, medium, easy.

    Args:
      pass_rates: {key: pass rate}, e.g. from `pass_rate`.
      num_buckets: the number of quantile buckets (ignored with `edges`).
      edges: increasing fixed bucket boundaries.

    Returns:
      Lists of keys, one per bucket; with quantiles, sizes differ by at most one.
    """
    keys = list(pass_rates)
    rates = np.array([pass_rates[k] for k in keys], np.float64)
    if edges is not None:
        edges = np.asarray(edges, np.float64)
        if edges.ndim != 1 or np.any(np.diff(edges) <= 0):
            raise ValueError(f"stratify edges must be strictly increasing, got {edges.tolist()}")
        bucket = np.searchsorted(edges, rates, side="right")
        return [
            [k for k, b in zip(keys, bucket, strict=True) if b == i] for i in range(len(edges) + 1)
        ]
    if num_buckets < 1:
        raise ValueError(f"stratify needs num_buckets >= 1, got {num_buckets}")
    order = np.argsort(rates, kind="stable")
    return [[keys[i] for i in part] for part in np.array_split(order, num_buckets)]


def bucket_names(count: int) -> list[str]:
    """hard, medium, easy for 3 buckets; else bucket_0 (hardest) ... bucket_<count-1>."""
    return ["hard", "medium", "easy"] if count == 3 else [f"bucket_{i}" for i in range(count)]


def stratify_records(
    pattern: str,
    out_dir: str,
    *,
    score_field: str = "",
    pass_rates: Mapping[int, float] | None = None,
    num_buckets: int = 3,
    edges: Sequence[float] | None = None,
    higher_is_easier: bool = True,
    names: Sequence[str] = (),
    suffix: str = ".jsonl",
    progress: bool = True,
) -> dict:
    """Writes the records of `pattern` to `<out_dir>/<bucket name><suffix>`, one file per
    difficulty bucket, and `<out_dir>/stratify.json` (the report, also returned: the buckets'
    names, sizes and score ranges, the records without a score).

    A record's score is its `score_field` value or `pass_rates[index]` (its 0-based position in
    `pattern`); records with neither are counted as unscored and left out. Scores are pass
    rates (higher is easier) unless `higher_is_easier=False` (e.g. a difficulty rating).
    Two passes over the records; only the scores are held in memory.
    """
    if bool(score_field) == (pass_rates is not None):
        raise ValueError("stratify: give a score field or a pass-rate map (exactly one)")
    kind_of(f"x{suffix}")  # a format the writer knows
    records = Records(pattern)  # both passes read it (JSON lines are scanned once)
    total = len(records)
    scores: dict[int, float] = {}
    unscored = 0
    for i, (record, where) in enumerate(
        tqdm(read_records(records), total=total, desc="scores", disable=not progress)
    ):
        value = record.get(score_field) if score_field else pass_rates.get(i)
        if value is None:
            unscored += 1
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: score {score_field}={value!r} is not a number")
        scores[i] = float(value) if higher_is_easier else -float(value)
    if not scores:
        raise ValueError(f"stratify: no record of {pattern} has a score ({score_field or 'map'})")
    buckets = stratify(scores, num_buckets=num_buckets, edges=edges)
    names = list(names) or bucket_names(len(buckets))
    if len(names) != len(buckets) or len(set(names)) != len(names):
        raise ValueError(f"stratify: {len(buckets)} buckets need as many distinct names: {names}")
    bucket_of = {i: b for b, keys in enumerate(buckets) for i in keys}
    writers = [RecordWriter(paths.join(out_dir, f"{n}{suffix}")) for n in names]
    try:
        for i, (record, _) in enumerate(
            tqdm(read_records(records), total=total, desc="buckets", disable=not progress)
        ):
            if i in bucket_of:
                writers[bucket_of[i]].write(record)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    for w in writers:
        w.close()
    sign = 1.0 if higher_is_easier else -1.0
    report = {
        "input": pattern,
        "score": score_field or "pass-rate map",
        "higher_is_easier": higher_is_easier,
        "buckets": [
            {
                "name": n,
                "path": paths.join(out_dir, f"{n}{suffix}"),
                "records": len(keys),
                "score_min": float(min(sign * scores[k] for k in keys)) if keys else None,
                "score_max": float(max(sign * scores[k] for k in keys)) if keys else None,
            }
            for n, keys in zip(names, buckets, strict=True)
        ],
        "unscored": unscored,
    }
    paths.write_text(paths.join(out_dir, "stratify.json"), json.dumps(report, indent=1) + "\n")
    return report


def read_pass_rates(path: str) -> dict[int, float]:
    """{record index: pass rate} from a JSON file: an RL run's difficulty.json
    ({"pass_rates": {...}}) or a plain {index: rate} object."""
    data = json.loads(paths.path(path).read_text())
    rates = data.get("pass_rates", data) if isinstance(data, dict) else None
    if not isinstance(rates, dict):
        raise ValueError(f"{path}: expected {{index: pass rate}} or an RL run's difficulty.json")
    try:
        return {int(k): float(v) for k, v in rates.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{path}: pass rates must map record indices to numbers") from None
