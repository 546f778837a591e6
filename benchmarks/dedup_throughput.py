"""Dedup throughput: `posttrain data dedup` (vectorised MinHash, LSH, both passes, all cores)
against a plain datasketch loop on the same synthetic corpus, with peak memory.

    python benchmarks/dedup_throughput.py --records=200000 --datasketch_records=20000

The corpus (generated on the fly into a temporary JSONL file) holds documents of 100-300 words
drawn from a Zipf-like 20,000-word vocabulary: 85% originals, 10% near copies of an earlier
original (1% of the words replaced, Jaccard ~0.9 on 5-word shingles) and 5% exact copies
(upper-cased, whitespace changed). Each side runs in a fresh process, so its peak RSS is its
own; ours reports the main process and its largest worker. The datasketch loop (one core, as
datasketch runs) reads the same JSON lines, normalises the same text, then per record
`MinHash(num_perm).update` per shingle, `MinHashLSH.query` and `insert` when nothing matched;
it runs on the first `--datasketch_records` records. Both report the share of planted copies
they drop (recall) and how many originals they drop (false drops).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time

import numpy as np
from _machine import cpu_model  # benchmarks/ is the script directory

VOCAB = 20_000


def _write_corpus(path: str, records: int, seed: int) -> None:
    """JSON lines {"id", "text", "copy_of"?} with planted near and exact copies."""
    words = np.array([f"w{i}" for i in range(VOCAB)])
    cdf = np.cumsum(1.0 / (np.arange(VOCAB) + 10.0))
    cdf /= cdf[-1]

    def original(k):  # regenerated from its index, so nothing is kept per record
        rng = np.random.default_rng([seed, k])
        return words[np.searchsorted(cdf, rng.random(int(rng.integers(100, 300))))]

    rng = np.random.default_rng(seed)
    originals: list[int] = []
    with open(path, "w") as f:
        for i in range(records):
            kind = rng.random() if originals else 0.0
            record = {"id": i}
            if kind < 0.85:
                originals.append(i)
                record["text"] = " ".join(original(i))
            else:
                j = originals[int(rng.integers(len(originals)))]
                doc = original(j)
                if kind < 0.95:
                    at = rng.choice(len(doc), max(1, len(doc) // 100), replace=False)
                    doc[at] = [f"x{v}" for v in rng.integers(10**6, size=len(at))]
                    record["text"] = " ".join(doc)
                else:
                    record["text"] = "  ".join(doc).upper()
                record["copy_of"] = j
            f.write(json.dumps(record) + "\n")


def _quality(path: str, dropped: set[int], limit: int) -> dict:
    """Recall over planted copies and originals dropped, among the first `limit` records."""
    copies = originals_dropped = found = 0
    with open(path) as f:
        for n, line in enumerate(f):
            if n >= limit:
                break
            record = json.loads(line)
            if "copy_of" in record:
                copies += 1
                found += record["id"] in dropped
            else:
                originals_dropped += record["id"] in dropped
    return {"recall": found / max(copies, 1), "originals_dropped": originals_dropped}


def _peak_mb(who) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def _ours(path: str, records: int, workers: int, queue) -> None:
    from posttrain.curate import dedup

    out = path + ".out.jsonl"
    t0 = time.perf_counter()
    report = dedup([path], out, workers=workers, progress=False)
    seconds = time.perf_counter() - t0
    with open(out) as f:
        kept = {json.loads(line)["id"] for line in f}
    os.remove(out)
    queue.put({
        "records": records, "seconds": seconds, "records_per_s": records / seconds,
        "passes_s": report["seconds"], "workers": workers,
        "peak_rss_mb": _peak_mb(resource.RUSAGE_SELF),
        "worker_peak_rss_mb": _peak_mb(resource.RUSAGE_CHILDREN),
        "lsh": f"{report['params']['bands']}x{report['params']['rows']}",
        **_quality(path, set(range(records)) - kept, records),
    })  # fmt: skip


def _datasketch(path: str, records: int, batch: bool, queue) -> None:
    from datasketch import MinHash, MinHashLSH

    from posttrain.curate import normalize, record_text

    lsh = MinHashLSH(threshold=0.8, num_perm=128)
    dropped = set()
    t0 = time.perf_counter()
    with open(path) as f:
        for n, line in enumerate(f):
            if n >= records:
                break
            record = json.loads(line)
            words = normalize(record_text(record)).split()
            shingles = {" ".join(words[i : i + 5]) for i in range(max(1, len(words) - 4))}
            m = MinHash(num_perm=128)
            if batch:
                m.update_batch([s.encode() for s in shingles])
            else:
                for s in shingles:
                    m.update(s.encode())
            if lsh.query(m):
                dropped.add(record["id"])
            else:
                lsh.insert(record["id"], m)
    seconds = time.perf_counter() - t0
    queue.put({
        "records": records, "seconds": seconds, "records_per_s": records / seconds,
        "workers": 1, "peak_rss_mb": _peak_mb(resource.RUSAGE_SELF),
        **_quality(path, dropped, records),
    })  # fmt: skip


def _run(target, *args) -> dict:
    """`target(*args, queue)` in a fresh process; what it put on the queue."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--datasketch_records", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/dedup_throughput_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.jsonl")
        t0 = time.perf_counter()
        _write_corpus(path, args.records, args.seed)
        mb = os.path.getsize(path) / 2**20
        print(f"corpus: {args.records} records, {mb:.0f} MiB, {time.perf_counter() - t0:.0f} s")
        subset = min(args.datasketch_records, args.records)
        results = {
            "posttrain dedup": _run(_ours, path, args.records, args.workers),
            "datasketch loop (update per shingle)": _run(_datasketch, path, subset, False),
            "datasketch loop (update_batch)": _run(_datasketch, path, subset, True),
        }
    command = "python " + " ".join(sys.argv)
    print(f"{command}\n{cpu_model()}; 5-word shingles, 128 permutations, threshold 0.8")
    print(f"{'':<38}{'records':>9}{'rec/s':>9}{'peak MiB':>10}{'recall':>8}{'false':>7}")
    for name, r in results.items():
        print(f"{name:<38}{r['records']:>9}{r['records_per_s']:>9.0f}{r['peak_rss_mb']:>10.0f}"
              f"{r['recall']:>8.3f}{r['originals_dropped']:>7}")  # fmt: skip
    ours = results["posttrain dedup"]
    print(f"ours: {ours['workers']} workers (largest worker {ours['worker_peak_rss_mb']:.0f} "
          f"MiB), LSH {ours['lsh']}, passes {ours['passes_s']}")  # fmt: skip
    base = results["datasketch loop (update per shingle)"]["records_per_s"]
    print(f"speed-up over the plain datasketch loop: {ours['records_per_s'] / base:.1f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"command": command, "cpu": cpu_model(), "args": vars(args), **results},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
