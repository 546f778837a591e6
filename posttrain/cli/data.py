"""`posttrain data <verb>`: the data tools (clean, dedup, decontaminate, ...), each a module
`posttrain.cli.data_<verb>` with the same flags parsing as the other commands and a library
function a notebook calls the same way (docs/data.md)."""

from __future__ import annotations

import difflib
import importlib

from posttrain.errors import UserError

# verb -> one line of help; the module posttrain.cli.data_<verb> runs it.
VERBS: dict[str, str] = {
    "clean": "normalise and filter chat/SFT records (Unicode, control characters, empty "
    "turns, length, language, chat structure); every drop counted by reason",
    "dedup": "remove exact and near-duplicate records (MinHash LSH), keeping the first of "
    "each cluster",
    "decontaminate": "drop training records that share 13-word n-grams with eval sets; report "
    "the eval items hit",
    "build": "write records as a versioned, content-addressed dataset (ArrayRecord shards + "
    "manifest) that training reads and verifies",
    "diff": "what changed between two builds (sources, parameters, records)",
    "stratify": "split records into difficulty buckets for a curriculum (data.curriculum)",
    "pairs": "on-policy preference pairs from a checkpoint: k samples per prompt, scored, "
    "chosen/rejected with margins",
    "synth": "rejection-sampled SFT data from a teacher checkpoint (generate, verify, keep)",
    "index": "a BM25 index of documents' passages for the retrieval environment (built once, "
    "reused)",
    "cad": "CAD tasks from the bundled generator: RL prompts, SFT chats and tool-call "
    "trajectories from reference scripts, a tokenizer",
}


def usage() -> str:
    width = max(map(len, VERBS)) + 2
    lines = [f"  {verb:<{width}}{text}" for verb, text in VERBS.items()]
    return "usage: posttrain data <verb> [flags]   (--help after a verb: its flags)\n\nverbs:\n" + (
        "\n".join(lines) or "  (none yet)"
    )


def main(argv: list[str]) -> int:
    """argv: ["posttrain data", verb, flags...] (the program name first, as absl flags want)."""
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb, rest = argv[1], argv[2:]
    if verb not in VERBS:
        near = difflib.get_close_matches(verb, VERBS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise UserError(f"unknown data verb {verb!r}{hint}\n\n{usage()}")
    return importlib.import_module(f"posttrain.cli.data_{verb}").main([f"{argv[0]} {verb}", *rest])
