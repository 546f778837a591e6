"""`posttrain data index`: a BM25 index of documents' passages, for the `retrieval` environment
(posttrain/data/_retrieval.py)."""

from __future__ import annotations

from posttrain.cli._flags import parse
from posttrain.errors import UserError

HELP = (
    'Cut documents ({"id", "text"} records) into passages and index them with BM25 '
    "(bm25s) into a folder that the retrieval environment searches (docs/agents.md). The same "
    "inputs and settings again rebuild nothing.",
    ["posttrain data index --input=docs.jsonl --out=runs/retrieval/index"],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_multi_string("input", [], "documents: a file, glob or dataset folder "
                                  "(repeatable)", flag_values=fv)  # fmt: skip
        flags.DEFINE_string("out", None, "the index folder", flag_values=fv)
        flags.DEFINE_integer("passage_words", 120, "words per passage (about)", flag_values=fv)
        flags.DEFINE_bool("overwrite", False, "replace an index of other inputs in --out",
                          flag_values=fv)  # fmt: skip

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.out:
        raise UserError("give --input (documents) and --out (the index folder)")
    if fv.passage_words < 8:
        raise UserError(f"--passage_words={fv.passage_words}: use 8 or more")
    from posttrain.data import build_index

    try:
        meta = build_index(fv.input, fv.out, passage_words=fv.passage_words,
                           overwrite=fv.overwrite)  # fmt: skip
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise UserError(str(e)) from None
    print(f"index {meta['id']}: {meta['status']} ({meta['documents']} documents, "
          f"{meta['passages']} passages) in {fv.out}")  # fmt: skip
    return 0
