"""`posttrain data clean`: clean SFT records (Unicode, control characters, empty turns, bounds,
language, chat structure), each source with its own rules, and report every drop by reason."""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.cli._flags import check_workers, parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "Clean SFT records into one file; each dropped record is counted under the first rule it "
    "fails (docs/data.md lists the rules in order). --overrides=FILE.json gives sources their "
    'own rules: {"PATTERN": {"max_chars": 4000, "languages": ["en"]}}, each PATTERN an --input.',
    [
        "posttrain data clean --input='raw/*.jsonl' --out=clean.jsonl --languages=en "
        "--max_chars=20000 --rejects=rejects.jsonl",
        "posttrain data clean --input=a.jsonl --input=b.parquet --overrides=rules.json "
        "--out=clean.arrayrecord",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_multi_string("input", [], "a file or glob to clean (repeat)", flag_values=fv)
        flags.DEFINE_string("out", None, "output .jsonl, .parquet or .arrayrecord", flag_values=fv)
        flags.DEFINE_string("rejects", None, "write dropped records and reasons to this .jsonl",
                            flag_values=fv)  # fmt: skip
        flags.DEFINE_string("overrides", None, "JSON file {input pattern: {option: value}}",
                            flag_values=fv)  # fmt: skip
        flags.DEFINE_string("stats", None, "write the counts as JSON to this file", flag_values=fv)
        flags.DEFINE_integer("workers", 0, "processes (0: one per CPU core)", flag_values=fv)
        define_overwrite(flags, fv)
        flags.DEFINE_string("normalize", "NFC", "NFC, NFKC, NFD, NFKD or none", flag_values=fv)
        flags.DEFINE_bool("strip_control", True, "remove control characters", flag_values=fv)
        flags.DEFINE_bool("drop_empty_turns", True, "remove empty messages", flag_values=fv)
        flags.DEFINE_bool("validate_chat", True, "check roles and tool calls", flag_values=fv)
        flags.DEFINE_integer("min_chars", 0, "fewest characters of text", flag_values=fv)
        flags.DEFINE_integer("max_chars", None, "most characters of text", flag_values=fv)
        flags.DEFINE_integer("min_turns", 0, "fewest user + assistant turns", flag_values=fv)
        flags.DEFINE_integer("max_turns", None, "most user + assistant turns", flag_values=fv)
        flags.DEFINE_list("languages", [], "keep these ISO codes, e.g. en,de", flag_values=fv)
        flags.DEFINE_float("min_language_confidence", 0.0, "smallest language probability",
                           flag_values=fv)  # fmt: skip

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.out:
        raise UserError("--input=PATTERN (one or more) and --out=FILE are required")
    check_workers(fv.workers)
    check_flags(fv, inputs=("input", "overrides"), outputs=("out", "rejects", "stats"))
    from posttrain.curate import CleanConfig, clean

    try:
        options = {"normalize": None if fv.normalize.lower() == "none" else fv.normalize.upper()}
        for name in ("strip_control", "drop_empty_turns", "validate_chat", "min_chars",
                     "max_chars", "min_turns", "max_turns", "min_language_confidence"):  # fmt: skip
            options[name] = getattr(fv, name)
        default = CleanConfig(**options, languages=tuple(fv.languages))
        sources = [(p, default.replace(o)) for p, o in _overrides(fv.overrides, fv.input)]
    except (FileNotFoundError, TypeError, ValueError) as e:
        raise UserError(str(e)) from None
    try:  # a missing input, an unsupported suffix, a source with no records
        stats = clean(sources, fv.out, rejects=fv.rejects, workers=fv.workers, progress=True)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    if fv.stats:
        Path(fv.stats).write_text(json.dumps(stats, indent=1) + "\n")
    _print(stats)
    print(f"wrote {stats['kept']} of {stats['read']} records to {fv.out}")
    return 0


def _overrides(path: str | None, inputs: list[str]) -> list[tuple[str, dict]]:
    """(pattern, its overrides) per input, from the --overrides JSON file."""
    table = {}
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--overrides={path}: no such file")
        with open(path) as f:
            table = json.load(f)
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
            raise ValueError(f'--overrides={path}: write {{"PATTERN": {{option: value}}, ...}}')
        if unknown := sorted(set(table) - set(inputs)):
            raise ValueError(f"--overrides={path} names {unknown}, which are no --input {inputs}")
    return [(p, table.get(p, {})) for p in inputs]


def _print(stats: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="posttrain data clean")
    for name, justify in (("source", "left"), ("read", "right"), ("kept", "right"),
                          ("dropped: reason", "left"), ("modified", "left")):  # fmt: skip
        table.add_column(name, justify=justify)
    for s in [*stats["sources"], {**stats, "pattern": "total"}]:
        dropped = ", ".join(f"{k} {v}" for k, v in s["dropped"].items()) or "-"
        modified = ", ".join(f"{k} {v}" for k, v in s["modified"].items()) or "-"
        table.add_row(s["pattern"], str(s["read"]), str(s["kept"]), dropped, modified)
    Console().print(table)
