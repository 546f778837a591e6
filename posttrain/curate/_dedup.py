"""`posttrain data dedup`: exact and near-duplicate removal within and across sources, keeping
the earliest record (in input order) of every group of duplicates.

Two passes over the inputs, never the corpus in memory:

1. Signatures, in parallel over chunks of records (`_chunks.map_chunks`): per record a 64-bit
   BLAKE2b hash of its normalised text (`_shingles.record_text` + `normalize`) and a MinHash
   signature of its word shingles, `num_perm` uint32 values. Only these stay in memory
   (8 + 4 * num_perm bytes a record). The MinHash is vectorised over a whole chunk: shingle
   hashes (`_shingles.ngram_hashes`) times `num_perm` random odd multipliers plus offsets, mod
   2**64 (a multiply-add hash family), the minimum per record and permutation, its top 32 bits
   kept.
2. Records with the same exact hash are duplicates of the first one. The first of each exact
   group goes into LSH: the signature cut into `bands` bands of `rows` values, records whose
   band agrees in any band are candidates, each candidate pair is kept if the fraction of equal
   signature values (the estimated Jaccard similarity of the shingle sets) is at least
   `threshold`, and union-find joins kept pairs into clusters whose representative is their
   earliest record. A second pass streams the records again and writes the representatives.

Clusters are transitive (a ~ b ~ c puts a and c together even if a and c are less similar).
Exact hashes are 64-bit: two different texts collide with probability ~n**2 / 2**65 (3e-8 for
a million records).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.curate._chunks import decoded, default_workers, map_chunks
from posttrain.curate._shingles import (
    ngram_hashes,
    normalize,
    position_constants,
    record_text,
    word_hashes,
)
from posttrain.data import Records, RecordWriter

_BLOCK = 1024  # shingles per MinHash block: a 1 MiB uint64 temporary at num_perm=128 (in cache)
_TOP = 10  # largest clusters named in the report
_WINDOW = 8  # earlier members of an LSH bucket each member is compared with


@dataclasses.dataclass(frozen=True)
class DedupConfig:
    """How `dedup` compares records.

    Attributes:
      threshold: estimated Jaccard similarity of two records' shingle sets at or above which
        they are near-duplicates.
      num_perm: MinHash permutations (signature length); the estimate's standard error is
        sqrt(J (1 - J) / num_perm), 0.035 at J = 0.8 and 128.
      shingle: words per shingle (records shorter than that give one shingle of all words).
      bands, rows: the LSH banding (bands * rows <= num_perm); 0 and 0 choose them with
        `lsh_params` weighting missed pairs 19 times false candidates: candidates are verified
        by their signatures, so a false one costs a comparison, a missed one a duplicate kept
        (16 x 8 at threshold 0.8 and 128 permutations).
      near: find near-duplicates; False removes exact duplicates only (no signatures).
      seed: the MinHash permutations' seed.
    """

    threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5
    bands: int = 0
    rows: int = 0
    near: bool = True
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if not 1 <= self.num_perm <= 1024:
            raise ValueError(f"num_perm must be 1 to 1024, got {self.num_perm}")
        if not 1 <= self.shingle <= 64:
            raise ValueError(f"shingle must be 1 to 64 words, got {self.shingle}")
        if (self.bands > 0) != (self.rows > 0) or self.bands * self.rows > self.num_perm:
            raise ValueError(
                f"bands={self.bands} rows={self.rows}: give both (bands * rows <= num_perm="
                f"{self.num_perm}) or neither"
            )

    def banding(self) -> tuple[int, int]:
        """(bands, rows): as given, or chosen by `lsh_params`."""
        if self.bands:
            return self.bands, self.rows
        return lsh_params(self.threshold, self.num_perm, fp_weight=0.05, fn_weight=0.95)


def lsh_params(
    threshold: float, num_perm: int, *, fp_weight: float = 0.5, fn_weight: float = 0.5
) -> tuple[int, int]:
    """The (bands, rows) with bands * rows <= num_perm that minimise the weighted areas of
    false positives (similarity below `threshold` made a candidate) and false negatives (above
    it, missed) under the banding curve 1 - (1 - s**rows)**bands: datasketch's choice."""
    below, above = np.linspace(0.0, threshold, 1001), np.linspace(threshold, 1.0, 1001)
    best, best_error = (1, num_perm), np.inf
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp = np.trapezoid(1.0 - (1.0 - below**rows) ** bands, below)
            fn = np.trapezoid((1.0 - above**rows) ** bands, above)
            error = fp_weight * fp + fn_weight * fn
            if error < best_error - 1e-12:
                best, best_error = (bands, rows), error
    return best


def _permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The multiply-add family's odd multipliers and offsets (uint64 [num_perm] each)."""
    rng = np.random.default_rng(seed)
    a = np.frombuffer(rng.bytes(8 * num_perm), "<u8") | np.uint64(1)
    b = np.frombuffer(rng.bytes(8 * num_perm), "<u8").copy()
    return a, b


def _minhash(shingles: np.ndarray, counts: np.ndarray, a: np.ndarray, b: np.ndarray):
    """uint32 [len(counts), num_perm]: per text the top 32 bits of min(a * x + b) over its
    shingles x (all ones for a text without shingles)."""
    sig = np.full((len(counts), len(a)), np.iinfo(np.uint64).max, np.uint64)
    rows = np.flatnonzero(counts > 0)
    offsets = np.concatenate(([0], np.cumsum(counts[rows])))
    buf = np.empty((_BLOCK, len(a)), np.uint64)
    r = 0
    while r < len(rows):  # blocks of whole texts, or slices of one text longer than a block
        stop = max(r + 1, int(np.searchsorted(offsets, offsets[r] + _BLOCK, "right")) - 1)
        first, last = offsets[r], offsets[stop]
        for lo in range(first, last, _BLOCK):
            hi = min(lo + _BLOCK, last)
            v = buf[: hi - lo]
            np.multiply(shingles[lo:hi, None], a[None, :], out=v)
            v += b
            if stop == r + 1:
                np.minimum(sig[rows[r]], v.min(axis=0), out=sig[rows[r]])
            else:
                sig[rows[r:stop]] = np.minimum.reduceat(v, offsets[r:stop] - first, axis=0)
        r = stop
    return (sig >> np.uint64(32)).astype(np.uint32)


def _signatures(texts: Sequence[str], a: np.ndarray, b: np.ndarray, shingle: int):
    """(exact hashes uint64 [n], signatures uint32 [n, len(a)], has-words bool [n])."""
    norm = [normalize(t) for t in texts]
    digests = b"".join(hashlib.blake2b(t.encode(), digest_size=8).digest() for t in norm)
    exact = np.frombuffer(digests, "<u8")
    words, counts = word_hashes(norm)
    if not len(a):
        return exact, np.zeros((len(texts), 0), np.uint32), counts > 0
    shingles, per_text = ngram_hashes(words, counts, shingle, short=True)
    return exact, _minhash(shingles, per_text, a, b), counts > 0


def _signature_chunk(records: list[dict], a: np.ndarray, b: np.ndarray, shingle: int):
    return _signatures([record_text(r) for r in records], a, b, shingle)


def minhash_signatures(
    texts: Sequence[str], *, num_perm: int = 128, shingle: int = 5, seed: int = 0
) -> np.ndarray:
    """MinHash signatures (uint32 [len(texts), num_perm]) of texts' normalised word shingles,
    as `dedup` computes them; the fraction of equal values estimates Jaccard similarity."""
    return _signatures(texts, *_permutations(num_perm, seed), shingle)[1]


def _candidate_pairs(sig: np.ndarray, ids: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """int64 [pairs, 2] (i < j): records of `ids` (ascending) that agree in some band. Within
    a bucket each member pairs with the `_WINDOW` members before it and with the bucket's first
    (linear work even for a large bucket, e.g. thousands of near-identical boilerplate records)."""
    constants = position_constants(rows)
    found = []
    for band in range(bands):
        block = sig[ids, band * rows : (band + 1) * rows].astype(np.uint64)
        key = (block * constants).sum(axis=1, dtype=np.uint64)
        order = np.argsort(key, kind="stable")  # ties stay in index order
        key = key[order]
        cont = np.flatnonzero(key[1:] == key[:-1]) + 1  # positions continuing a bucket
        if not len(cont):
            continue
        starts = np.where(np.concatenate(([True], key[1:] != key[:-1])), np.arange(len(key)), 0)
        first = np.maximum.accumulate(starts)[cont]
        member = ids[order[cont]]
        found += [np.stack([ids[order[first]], member], 1)]
        for back in range(1, _WINDOW + 1):
            ok = cont - back >= first
            found += [np.stack([ids[order[cont[ok] - back]], member[ok]], 1)]
    if not found:
        return np.zeros((0, 2), np.int64)
    return np.unique(np.concatenate(found), axis=0)


def _similar(sig: np.ndarray, pairs: np.ndarray, threshold: float) -> np.ndarray:
    """The pairs whose signatures agree in at least `threshold` of their values."""
    need = threshold * sig.shape[1] - 1e-9
    keep = np.zeros(len(pairs), bool)
    for lo in range(0, len(pairs), 1 << 16):
        p = pairs[lo : lo + (1 << 16)]
        keep[lo : lo + len(p)] = (sig[p[:, 0]] == sig[p[:, 1]]).sum(axis=1) >= need
    return pairs[keep]


def _roots(n: int, edges: np.ndarray) -> np.ndarray:
    """Union-find over `edges`: per record the smallest index of its connected component."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while (p := parent.get(x, x)) != x:
            parent[x] = x = parent.get(p, p)  # path halving
        return x

    for i, j in edges.tolist():
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    roots = np.arange(n)
    for x in parent:
        roots[x] = find(x)
    return roots


def dedup(
    inputs: Sequence[str],
    out: str,
    config: DedupConfig | None = None,
    *,
    clusters: str | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Writes the records of `inputs` without exact and near duplicates to `out`.

    Args:
      inputs: files or globs (JSONL, Parquet, ArrayRecord; local or gs://), read in order;
        duplicates are found within and across them.
      out: the output file (its suffix picks the format); the kept records, in input order.
      config: thresholds and MinHash/LSH parameters (default `DedupConfig()`).
      clusters: a JSON-lines file to write every cluster of duplicates to (representative
        location, size, and the members dropped as exact and as near copies).
      workers: processes for the signature pass (default: one per CPU core).
      progress: show progress bars.

    Returns:
      The report: counts kept and dropped (exact, near), clusters, the largest clusters,
      the parameters (with the banding used) and the time taken by each pass.

    Raises:
      FileNotFoundError: an input names no file.
      ValueError: an input holds a malformed record (named by location) or no records.
    """
    t0 = time.perf_counter()
    config = config or DedupConfig()
    sources = [Records(p) for p in inputs]
    bands, rows = config.banding()
    exact, sig, has_words = _pass_one(sources, config, workers or default_workers(), progress)
    t1 = time.perf_counter()

    _, first, inverse = np.unique(exact, return_index=True, return_inverse=True)
    exact_rep = first[inverse]  # the first record with the same normalised text
    n, index = len(exact), np.arange(len(exact))
    pairs = similar = np.zeros((0, 2), np.int64)
    if config.near:
        ids = np.flatnonzero((exact_rep == index) & has_words)
        pairs = _candidate_pairs(sig, ids, bands, rows)
        similar = _similar(sig, pairs, config.threshold)
    del sig
    rep = _roots(n, similar)[exact_rep]  # each record's cluster's earliest record
    size = np.bincount(rep, minlength=n)
    reps = np.flatnonzero(size > 1)
    top = reps[np.lexsort((reps, -size[reps]))][:_TOP]
    t2 = time.perf_counter()

    wanted = size[rep] > 1 if clusters else np.isin(rep, top)
    members = _pass_two(sources, out, rep, exact_rep, wanted, listed=None if clusters else 5)
    if clusters:
        with RecordWriter(clusters) as writer:
            for r, c in members.items():
                writer.write({"size": int(size[r]), **c})
    t3 = time.perf_counter()

    kept = int((rep == index).sum())
    dropped_exact = int((exact_rep != index).sum())
    return {
        "inputs": list(inputs),
        "out": out,
        "records": n,
        "kept": kept,
        "dropped_exact": dropped_exact,
        "dropped_near": n - kept - dropped_exact,
        "clusters": len(reps),
        "largest_clusters": [
            {
                "representative": members[r]["representative"],
                "size": int(size[r]),
                "members": (members[r]["exact"] + members[r]["near"])[:5],
            }
            for r in top.tolist()
        ],
        "candidate_pairs": len(pairs),
        "similar_pairs": len(similar),
        "params": {**dataclasses.asdict(config), "bands": bands, "rows": rows},
        "seconds": {"signatures": t1 - t0, "clusters": t2 - t1, "write": t3 - t2},
        "records_per_s": n / max(t3 - t0, 1e-9),
    }


def _pass_one(sources: list[Records], config: DedupConfig, workers: int, progress: bool):
    """(exact hashes uint64 [n], signatures uint32 [n, num_perm], has-words bool [n]) of all
    records, computed in parallel chunks (no signatures when `config.near` is off)."""
    starts = np.cumsum([0, *map(len, sources)])
    a, b = _permutations(config.num_perm if config.near else 0, config.seed)
    exact = np.empty(starts[-1], np.uint64)
    sig = np.empty((starts[-1], len(a)), np.uint32)
    has_words = np.empty(starts[-1], bool)
    work = map_chunks(
        sources, _signature_chunk, (a, b, config.shingle),
        workers=workers, desc="dedup: signatures", progress=progress,
    )  # fmt: skip
    for (s, lo, hi), (e, g, w) in work:
        at = slice(starts[s] + lo, starts[s] + hi)
        exact[at], sig[at], has_words[at] = e, g, w
    return exact, sig, has_words


def _pass_two(sources, out, rep, exact_rep, wanted, listed) -> dict[int, dict[str, Any]]:
    """Writes the records that represent themselves to `out`; returns, per cluster with a
    `wanted` record, its representative's location and its members' ("exact" and "near",
    at most `listed` of them unless None), keyed by the representative's index."""
    members: dict[int, dict[str, Any]] = {}
    g = 0
    with RecordWriter(out) as writer:
        for records in sources:
            for i in range(len(records)):
                raw, where = records[i]
                if rep[g] == g:
                    writer.write(decoded(raw, where))
                if wanted[g]:
                    c = members.setdefault(int(rep[g]), {"exact": [], "near": []})
                    if rep[g] == g:
                        c["representative"] = where
                    elif listed is None or len(c["exact"]) + len(c["near"]) < listed:
                        c["exact" if exact_rep[g] != g else "near"].append(where)
                g += 1
    return {r: {"representative": c["representative"], "exact": c["exact"], "near": c["near"]}
            for r, c in members.items()}  # fmt: skip
