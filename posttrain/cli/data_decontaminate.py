"""`posttrain data decontaminate`: drop training records sharing long n-grams with eval sets."""

from __future__ import annotations

import json

from posttrain.cli._flags import check_workers, parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "Drop training records that share word n-grams (default 13) with any eval item, and report "
    "which eval items were hit (docs/data.md).",
    [
        "posttrain data decontaminate --input=train.jsonl --eval=evals/gsm8k_test.jsonl "
        "--out=clean.jsonl --report=contamination.json",
        "posttrain data decontaminate --input='sft/*.parquet' --eval=questions.txt --ngram=8 "
        "--min-count=2 --out=clean.parquet",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_multi_string(
            "input",
            [],
            "training records: a file or glob (JSONL/"
            "Parquet/ArrayRecord, local or gs://); repeat for more",
            flag_values=fv,
        )
        flags.DEFINE_multi_string(
            "eval",
            [],
            "an eval set: records (every string counts) or a "
            ".txt file (one item a line); repeat for more",
            flag_values=fv,
        )
        flags.DEFINE_string("out", None, "output file; its suffix picks the format", flag_values=fv)
        flags.DEFINE_integer("ngram", 13, "words per n-gram", flag_values=fv)
        flags.DEFINE_integer(
            "min_count",
            1,
            "distinct shared n-grams that make a record contaminated",
            flag_values=fv,
        )
        flags.DEFINE_integer("workers", 0, "processes (default: one per CPU core)", flag_values=fv)
        flags.DEFINE_string("report", "", "write the report to this JSON file", flag_values=fv)
        define_overwrite(flags, fv)

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.eval or not fv.out:
        raise UserError("--input=FILE_OR_GLOB, --eval=FILE_OR_GLOB and --out=FILE are required")
    check_workers(fv.workers)
    check_flags(fv, inputs=("input", "eval"), outputs=("out", "report"))
    from rich.console import Console
    from rich.table import Table

    from posttrain import paths
    from posttrain.curate import DecontamConfig, decontaminate

    try:
        config = DecontamConfig(ngram=fv.ngram, min_count=fv.min_count)
    except ValueError as e:
        raise UserError(f"{e}; change the flag") from None
    report = decontaminate(fv.input, fv.out, fv.eval, config, workers=fv.workers or None)
    if fv.report:
        paths.write_text(fv.report, json.dumps(report, indent=2) + "\n")
    table = Table(title=f"decontaminate: {report['records']} records -> {fv.out}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    for name, value in [
        ("kept", report["kept"]),
        ("dropped", report["dropped"]),
        ("eval items", report["eval_items"]),
        ("eval items hit", report["eval_items_hit"]),
        (f"eval items < {fv.ngram} words", report["eval_items_without_ngrams"]),
        (f"sharing < {fv.min_count} n-grams (kept)", report["sharing_below_min_count"]),
    ]:
        table.add_row(name, str(value))
    Console().print(table)
    worst = sorted(report["hits"], key=lambda h: -h["records"])[:10]
    if worst:
        hits = Table(title="eval items hit (most first)")
        hits.add_column("eval item")
        hits.add_column("training records", justify="right")
        for h in worst:
            hits.add_row(h["location"], str(h["records"]))
        Console().print(hits)
    return 0
