"""`posttrain data dedup`: exact and near-duplicate (MinHash LSH) removal across inputs."""

from __future__ import annotations

import json

from posttrain.cli._flags import check_workers, parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "Remove exact duplicates (same normalised text) and near-duplicates (MinHash LSH over word "
    "shingles) within and across the inputs, keeping the first record of each cluster "
    "(docs/data.md).",
    [
        "posttrain data dedup --input=chats/*.jsonl --input=extra.parquet --out=dedup.jsonl",
        "posttrain data dedup --input=data.jsonl --out=dedup.jsonl --threshold=0.7 "
        "--clusters=clusters.jsonl --report=dedup.json",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_multi_string(
            "input",
            [],
            "records: a file or glob (JSONL/Parquet/ArrayRecord, local or gs://); repeat for more",
            flag_values=fv,
        )
        flags.DEFINE_string("out", None, "output file; its suffix picks the format", flag_values=fv)
        flags.DEFINE_float(
            "threshold",
            0.8,
            "estimated Jaccard similarity of word shingles at "
            "or above which records are near-duplicates",
            flag_values=fv,
        )
        flags.DEFINE_integer("num_perm", 128, "MinHash permutations", flag_values=fv)
        flags.DEFINE_integer("shingle", 5, "words per shingle", flag_values=fv)
        flags.DEFINE_integer(
            "bands", 0, "LSH bands (with --rows; default: chosen for the threshold)", flag_values=fv
        )
        flags.DEFINE_integer("rows", 0, "LSH rows per band (with --bands)", flag_values=fv)
        flags.DEFINE_bool(
            "near", True, "find near-duplicates; --nonear: exact duplicates only", flag_values=fv
        )
        flags.DEFINE_integer("seed", 0, "MinHash permutations' seed", flag_values=fv)
        flags.DEFINE_integer("workers", 0, "processes (default: one per CPU core)", flag_values=fv)
        flags.DEFINE_string(
            "clusters", "", "write every cluster to this JSONL file", flag_values=fv
        )
        flags.DEFINE_string("report", "", "write the report to this JSON file", flag_values=fv)
        define_overwrite(flags, fv)

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.out:
        raise UserError("--input=FILE_OR_GLOB (repeatable) and --out=FILE are required")
    check_workers(fv.workers)
    check_flags(fv, inputs=("input",), outputs=("out", "clusters", "report"))
    from rich.console import Console
    from rich.table import Table

    from posttrain import paths
    from posttrain.curate import DedupConfig, dedup

    try:
        config = DedupConfig(
            threshold=fv.threshold,
            num_perm=fv.num_perm,
            shingle=fv.shingle,
            bands=fv.bands,
            rows=fv.rows,
            near=fv.near,
            seed=fv.seed,
        )
    except ValueError as e:
        raise UserError(f"{e}; change the flag") from None
    report = dedup(
        fv.input, fv.out, config, clusters=fv.clusters or None, workers=fv.workers or None
    )
    if fv.report:
        paths.write_text(fv.report, json.dumps(report, indent=2) + "\n")
    p = report["params"]
    table = Table(title=f"dedup: {report['records']} records -> {fv.out}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    for name, value in [
        ("kept", report["kept"]),
        ("dropped: exact", report["dropped_exact"]),
        ("dropped: near", report["dropped_near"]),
        ("clusters", report["clusters"]),
        ("largest cluster", max((c["size"] for c in report["largest_clusters"]), default=0)),
        ("LSH", f"{p['bands']} bands x {p['rows']} rows, threshold {p['threshold']}"),
        ("records/s", f"{report['records_per_s']:,.0f}"),
    ]:
        table.add_row(name, str(value))
    Console().print(table)
    return 0
