"""`posttrain data build`: records as a versioned, content-addressed dataset that training reads
by its directory (posttrain/curate/_build.py)."""

from __future__ import annotations

import json
import os

from posttrain.cli._flags import parse
from posttrain.errors import UserError

HELP = (
    "Write records as an immutable build, <out>/<build id>/: ArrayRecord shards and a "
    "manifest.json (sources, params, counts, hashes). The same records and params give the same "
    "id and bytes; a build already there is verified, not rewritten. Train on it by giving the "
    "build directory as a data source path.",
    [
        "posttrain data build --input=clean/chats.jsonl --out=builds",
        "posttrain data build --input='raw/*.parquet' --input=extra.jsonl --out=gs://bucket/builds "
        "--params=dedup_report.json --param=note=first-pass",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_multi_string(
            "input", [], "source file or glob (JSON lines, Parquet, ArrayRecord or a build; local "
            "or gs://); repeat for several, read in the order given", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_string("out", None, "folder the build goes in, as <out>/<id>/", flag_values=fv)
        flags.DEFINE_integer("shard_records", 100_000, "records per shard", flag_values=fv)
        flags.DEFINE_multi_string(
            "params", [], "a JSON file (e.g. a clean or dedup report) kept in the manifest and "
            "hashed into the id, under its name without suffix; repeatable", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_multi_string(
            "param", [], "key=value kept in the manifest and hashed into the id (the value read "
            "as JSON when it parses, else as text); repeatable", flag_values=fv,
        )  # fmt: skip

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.out:
        raise UserError("--input=FILE_OR_GLOB (one or more) and --out=DIR are required")
    if fv.shard_records < 1:
        raise UserError(f"--shard_records={fv.shard_records}: give a positive number")
    from posttrain import paths

    if not paths.is_remote(fv.out) and os.path.lexists(fv.out) and not os.path.isdir(fv.out):
        raise UserError(f"--out={fv.out} is a file; give the folder builds go in (<out>/<id>/)")
    from posttrain.curate import build_dataset

    result = build_dataset(
        fv.input, fv.out, shard_records=fv.shard_records, params=_params(fv.params, fv.param)
    )
    _print(result)
    return 0


def _params(files: list[str], pairs: list[str]) -> dict:
    """--params files (by name without suffix) and --param key=value pairs as one dict."""
    from posttrain import paths

    params = {}
    for file in files:
        key = os.path.splitext(os.path.basename(file))[0]
        try:
            params[key] = json.loads(paths.path(file).read_text())
        except FileNotFoundError:
            raise UserError(f"--params={file}: no such file") from None
        except ValueError as e:
            raise UserError(f"--params={file}: not JSON ({e})") from None
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq or not key:
            raise UserError(f"--param={pair}: write key=value")
        try:
            params[key] = json.loads(text)
        except ValueError:
            params[key] = text
    if len(params) < len(files) + len(pairs):
        raise UserError("--params file names and --param keys must all differ")
    return params


def _print(result) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    m = result.manifest
    table = Table()
    for column in ("source", "files", "records"):
        table.add_column(column, overflow="fold")
    for source in m["sources"]:
        table.add_row(escape(source["pattern"]), str(len(source["files"])),
                      str(source["records"]))  # fmt: skip
    table.add_section()
    table.add_row("total", str(sum(len(s["files"]) for s in m["sources"])),
                  str(m["counts"]["records"]))  # fmt: skip
    console = Console()
    console.print(table)
    state = "already built (verified)" if result.reused else "written"
    params = ", ".join(sorted(m["params"])) or "none"
    console.print(f"build {result.id}: {state}", soft_wrap=True)
    console.print(f"{m['counts']['shards']} shard(s) in {escape(result.path)}; params: "
                  f"{escape(params)}", soft_wrap=True)  # fmt: skip
