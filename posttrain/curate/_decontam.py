"""`posttrain data decontaminate`: drop training records that share long word n-grams with
eval items, and report which eval items were hit and by how many records.

An n-gram is `ngram` consecutive words (default 13, as in GPT-3's decontamination) of one text
field, after normalisation (NFKC, case folding) and with punctuation dropped (`\\w+` words), so
"The answer is 42." and "the answer is 42" match. Every string of a record counts (prompt,
answer, each message's content, ...), each field on its own: an n-gram never spans two fields.
The eval items' n-grams (64-bit hashes, with the items holding each) stay in memory; training
records stream past them in parallel chunks and are written out unless they share at least
`min_count` distinct n-grams with the eval items. An eval text shorter than `ngram` words has no
n-gram and cannot be matched; the report counts those items.
"""

from __future__ import annotations

import dataclasses
import glob
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain import paths
from posttrain.curate._chunks import decoded, default_workers, map_chunks
from posttrain.curate._shingles import all_strings, ngram_hashes, word_hashes, words_only
from posttrain.data import Records, RecordWriter, read_records

_LISTED = 5  # eval items named per dropped record in the report


@dataclasses.dataclass(frozen=True)
class DecontamConfig:
    """What counts as contamination.

    Attributes:
      ngram: words per n-gram.
      min_count: distinct eval n-grams a training record must share to be dropped.
    """

    ngram: int = 13
    min_count: int = 1

    def __post_init__(self):
        if not 1 <= self.ngram <= 64:
            raise ValueError(f"ngram must be 1 to 64 words, got {self.ngram}")
        if self.min_count < 1:
            raise ValueError(f"min_count must be at least 1, got {self.min_count}")


def _ngrams(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n-gram hashes, n-grams per text) of texts, each text on its own."""
    words, counts = word_hashes([words_only(t) for t in texts])
    return ngram_hashes(words, counts, n, short=False)


def read_eval_items(patterns: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(location, texts) per eval item: each record of JSONL/Parquet/ArrayRecord files (all its
    strings), or each non-blank line of .txt files. Files or globs, local or gs://."""
    items = []
    for pattern in patterns:
        if not pattern.endswith(".txt"):
            items += [(where, all_strings(r)) for r, where in read_records(pattern)]
            continue
        files = paths.glob(pattern) if glob.has_magic(pattern) else [pattern]
        if not files or not paths.path(files[0]).is_file():
            raise FileNotFoundError(f"eval set {pattern} matches no file")
        for f in files:
            lines = paths.path(f).read_text().splitlines()
            items += [(f"{f} line {i + 1}", [t]) for i, t in enumerate(lines) if t.strip()]
    return items


class EvalIndex:
    """The eval items' n-grams: sorted unique hashes, and for each the items that hold it."""

    def __init__(self, items: Sequence[tuple[str, list[str]]], n: int):
        self.locations = [where for where, _ in items]
        hashes, owners = [], []
        for k, (_, texts) in enumerate(items):
            h = np.unique(_ngrams(texts, n)[0])
            hashes.append(h)
            owners.append(np.full(len(h), k, np.int64))
        self.empty_items = sum(len(h) == 0 for h in hashes)
        h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
        order = np.lexsort((owner, h))
        h, self._owner = h[order], owner[order]
        self.keys, self._first = np.unique(h, return_index=True)
        self._bounds = np.append(self._first, len(h))

    def items(self, keys: np.ndarray) -> np.ndarray:
        """The sorted eval item indices holding any of the n-grams at positions `keys`."""
        parts = [self._owner[self._bounds[k] : self._bounds[k + 1]] for k in keys.tolist()]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _hits(records: list[dict], keys: np.ndarray, n: int) -> list[tuple[int, np.ndarray]]:
    """(record index in the chunk, positions in `keys` of the eval n-grams it shares) for the
    chunk's records that share any."""
    texts = [all_strings(r) for r in records]
    owner = np.repeat(np.arange(len(records)), [len(t) for t in texts])
    hashes, per_text = _ngrams([s for t in texts for s in t], n)
    if not len(hashes) or not len(keys):
        return []
    at = np.minimum(np.searchsorted(keys, hashes), len(keys) - 1)
    match = keys[at] == hashes
    if not match.any():
        return []
    pairs = np.unique(np.stack([np.repeat(owner, per_text)[match], at[match]], 1), axis=0)
    split = np.flatnonzero(np.diff(pairs[:, 0])) + 1
    return [(int(g[0, 0]), g[:, 1]) for g in np.split(pairs, split)]


def decontaminate(
    inputs: Sequence[str],
    out: str,
    evals: Sequence[str],
    config: DecontamConfig | None = None,
    *,
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Writes the records of `inputs` that share fewer than `min_count` n-grams with the eval
    items of `evals` to `out`.

    Args:
      inputs: training files or globs (JSONL, Parquet, ArrayRecord; local or gs://).
      out: the output file (its suffix picks the format); the kept records, in input order.
      evals: eval sets: record files or globs (every string of a record is its text) or .txt
        files (one item per non-blank line).
      config: n-gram length and minimum shared count (default `DecontamConfig()`).
      workers: processes (default: one per CPU core).
      progress: show a progress bar.

    Returns:
      The report: records kept and dropped, the eval items hit (location and how many training
      records hit each), each dropped record (location, shared n-grams, eval items), and how
      many eval items were too short to have an n-gram.

    Raises:
      FileNotFoundError: an input or eval set names no file.
      ValueError: a malformed record (named by location), or no eval items at all.
    """
    t0 = time.perf_counter()
    config = config or DecontamConfig()
    items = read_eval_items(evals)
    if not items:
        raise ValueError(f"the eval sets {list(evals)} hold no items")
    index = EvalIndex(items, config.ngram)
    sources = [Records(p) for p in inputs]
    hit_count = np.zeros(len(items), np.int64)
    dropped, below, n = [], 0, 0
    work = map_chunks(
        sources, _hits, (index.keys, config.ngram),
        workers=workers or default_workers(), desc="decontaminate", progress=progress,
    )  # fmt: skip
    with RecordWriter(out) as writer:
        for (s, lo, hi), hits in work:
            drop = {}
            for i, keys in hits:
                if len(keys) >= config.min_count:
                    drop[lo + i] = keys
                else:
                    below += 1
            for i in range(lo, hi):
                raw, where = sources[s][i]
                if i not in drop:
                    writer.write(decoded(raw, where))
                    continue
                owners = index.items(drop[i])
                hit_count[owners] += 1
                names = [index.locations[k] for k in owners[:_LISTED].tolist()]
                dropped.append({"location": where, "ngrams": len(drop[i]), "eval_items": names})
            n += hi - lo
    hit = np.flatnonzero(hit_count)
    return {
        "inputs": list(inputs),
        "evals": list(evals),
        "out": out,
        "records": n,
        "kept": n - len(dropped),
        "dropped": len(dropped),
        "sharing_below_min_count": below,
        "eval_items": len(items),
        "eval_items_without_ngrams": index.empty_items,
        "eval_items_hit": len(hit),
        "hits": [{"location": index.locations[k], "records": int(hit_count[k])} for k in hit],
        "dropped_records": dropped,
        "params": dataclasses.asdict(config),
        "seconds": time.perf_counter() - t0,
    }
