"""The sweep's results: each trial's final and best metric from its logs, the summary over
seeds, the CSV files and the printed tables."""

from __future__ import annotations

import csv
import json
import math
import statistics


def metric_history(trial_dir: str, metric: str, mode: str) -> dict:
    """The final and best logged value of `metric` (train or eval rows) and their steps."""
    from posttrain.train import read_metrics

    try:
        rows = [r for split in ("train", "eval") for r in read_metrics(trial_dir, split)]
    except json.JSONDecodeError:  # the last line of a killed run; its resume rewrites the file
        rows = []
    logged = sorted({k for r in rows for k in r} - {"step", "split"})
    rows = sorted((r for r in rows if metric in r), key=lambda r: r["step"])
    if not rows:
        return {"logged": logged}
    sign = 1 if mode == "min" else -1
    best = min(rows, key=lambda r: (sign * r[metric], r["step"]))  # the earliest of ties
    return {
        "final": rows[-1][metric], "final_step": rows[-1]["step"],
        "best": best[metric], "best_step": best["step"], "logged": logged,
    }  # fmt: skip


def summarize(rows: list[dict], keys: list[str], metric: str, mode: str) -> list[dict]:
    """Mean and sample std (n - 1; None below two) over seeds of each value combination's
    final and best `metric`, over its finished trials; best combination first."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(json.dumps([row[key] for key in keys]), []).append(row)
    out = []
    for members in groups.values():
        done = [r for r in members if r["status"] == "finished"]  # each has the metric
        entry = {key: members[0][key] for key in keys}
        entry.update(trials=len(members), finished=len(done))
        for which in ("final", "best"):
            xs = [r[f"{which}_{metric}"] for r in done]
            entry[f"mean_{which}_{metric}"] = statistics.fmean(xs) if xs else None
            entry[f"std_{which}_{metric}"] = statistics.stdev(xs) if len(xs) > 1 else None
        out.append(entry)
    sign, mean = (1 if mode == "min" else -1), f"mean_final_{metric}"
    return sorted(out, key=lambda e: math.inf if e[mean] is None else sign * e[mean])


def _write_csv(path: str, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _mean_std(group: dict, name: str) -> str:
    mean, std = group[f"mean_{name}"], group[f"std_{name}"]
    return _cell(mean) if std is None else f"{_cell(mean)} ± {_cell(std)}"


def _print_summary(console, rows: list[dict], groups: list[dict], keys: list[str], sweep: dict):
    from rich.markup import escape
    from rich.table import Table

    metric = sweep["metric"]
    table = Table(title=f"trials ({metric}, {sweep['mode']} is best)")
    columns = [c for c in rows[0] if c != "error"]  # errors go below the table, in full
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row[c]) for c in columns))
    console.print(table)
    for row in rows:
        if row["error"]:
            console.print(f"{escape(row['trial'])} failed: {escape(row['error'])}")
    table = Table(title="over seeds: mean ± std")
    for column in [*keys, "finished", f"final {metric}", f"best {metric}"]:
        table.add_column(column, overflow="fold")
    for g in groups:
        pm = [_mean_std(g, f"{which}_{metric}") for which in ("final", "best")]
        table.add_row(*(_cell(g[k]) for k in keys), f"{g['finished']}/{g['trials']}", *pm)
    console.print(table)
    if groups and groups[0]["finished"]:
        best = groups[0]
        values = ",".join(f"{k}={best[k]}" for k in keys) or "the base config"
        console.print(
            f"best: {values}: final {metric} {_cell(best[f'mean_final_{metric}'])} ± "
            f"{_cell(best[f'std_final_{metric}'])} over {best['finished']} run(s)"
        )
