"""`posttrain data diff A B`: what changed between two builds (posttrain/curate/_build.py)."""

from __future__ import annotations

from posttrain.cli._flags import parse
from posttrain.errors import UserError

HELP = (
    "Show what changed from build A to build B: source files (by sha256), params, counts, and "
    "the records removed and added (by content hash, with where they are and a preview).",
    ["posttrain data diff builds/3f2a9c0d1e4b5a67 builds/9e1b0c2d3f4a5b6c --limit=50"],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_integer(
            "limit", 20, "records shown per side (all are counted)", flag_values=fv
        )

    builds = [a for a in argv[1:] if not a.startswith("-")]
    fv = parse([argv[0], *(a for a in argv[1:] if a.startswith("-"))], define, HELP)
    if len(builds) != 2:
        raise UserError(
            f"give two build directories, A and B (got {len(builds)}: {builds}); write flags "
            "as --limit=N"
        )
    from posttrain.curate import diff_builds

    _print(diff_builds(*builds, limit=max(fv.limit, 0)))
    return 0


def _print(d) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title="builds")
    for column in ("", "id", "records", "shards", "path"):
        table.add_column(column, overflow="fold")
    for side, build in (("A", d.a), ("B", d.b)):
        table.add_row(side, build["id"], str(build["records"]), str(build["shards"]),
                      escape(build["path"]))  # fmt: skip
    console.print(table)
    if d.same:
        console.print("the same records from the same files with the same params")
        return
    if d.sources:
        table = Table(title="source files")
        for column in ("change", "path", "sha256 A", "sha256 B"):
            table.add_column(column, overflow="fold")
        for s in d.sources:
            short = [(v or "-")[:12] for v in (s["a"], s["b"])]
            table.add_row(s["change"], escape(s["path"]), *short)
        console.print(table)
    if d.params:
        table = Table(title="params")
        for column in ("key", "A", "B"):
            table.add_column(column, overflow="fold")
        for p in d.params:
            table.add_row(escape(p["key"]), escape(repr(p["a"])), escape(repr(p["b"])))
        console.print(table)
    console.print(f"records: {d.removed} removed (-), {d.added} added (+)")
    shown = len(d.removed_records) + len(d.added_records)
    if shown:
        table = Table()
        for column in ("", "hash", "where", "text"):
            table.add_column(column, overflow="fold")
        for sign, changes in (("-", d.removed_records), ("+", d.added_records)):
            for c in changes:
                table.add_row(sign, c.hash, c.location, escape(c.preview))
        console.print(table)
    if shown < d.removed + d.added:
        console.print(f"({d.removed + d.added - shown} more not shown; --limit=N shows more)")
