"""When `posttrain data dedup`'s workers pay: the whole dedup of a synthetic corpus (the one
`dedup_throughput.py` writes) with 1 worker, with 2 as shipped (the first chunk is timed here
and workers start only when the rest would pay for them), and with 2 always started (the
behaviour before: `POOL_START_S = 0`), plus what a pool of spawned workers takes to start.

    python benchmarks/dedup_workers.py --records=3000 --records=100000

Each run is a fresh process (imports and JAX included as a user's command has them).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time

from _machine import cpu_model  # benchmarks/ is the script directory
from dedup_throughput import _write_corpus


def _noop(_):
    return os.getpid()


def _pool_start(workers: int, queue) -> None:
    """Seconds from starting a spawned pool to every worker having answered (each imports
    posttrain.curate, as a dedup worker does when it unpickles its function)."""
    from posttrain.curate import _chunks

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, _chunks._init, ([None], _noop, ())) as pool:
        pids = set()
        while len(pids) < workers:
            pids.update(pool.map(_chunks._run, [(0, 0, 0)] * (4 * workers), chunksize=1))
    queue.put(time.perf_counter() - t0)


def _dedup(path: str, workers: int, forced: bool, queue) -> None:
    from posttrain.curate import _chunks, dedup

    if forced:
        _chunks.POOL_START_S = 0.0
    t0 = time.perf_counter()
    dedup([path], path + f".{workers}{forced}.out", workers=workers, progress=False)
    queue.put(time.perf_counter() - t0)


def _fresh(fn, *args) -> float:
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=fn, args=(*args, queue))
    process.start()
    value = queue.get()
    process.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, action="append")
    parser.add_argument("--json", default="benchmarks/results/dedup_workers_cpu.json")
    args = parser.parse_args()
    results = {"pool start, 2 workers (s)": _fresh(_pool_start, 2), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for records in args.records or [3000, 100_000]:
            path = os.path.join(tmp, f"corpus{records}.jsonl")
            _write_corpus(path, records, 0)
            row = {"records": records}
            for name, workers, forced in (("1 worker", 1, False), ("2 workers", 2, False),
                                          ("2 always started", 2, True)):  # fmt: skip
                row[name] = _fresh(_dedup, path, workers, forced)
            results["runs"].append(row)
    command = "python " + " ".join(sys.argv)
    print(f"{command}\n{cpu_model()}")
    print(f"pool start, 2 spawned workers: {results['pool start, 2 workers (s)']:.1f} s")
    print(f"{'records':>9}{'1 worker':>11}{'2 workers':>11}{'2 always':>11}   (seconds)")
    for r in results["runs"]:
        print(f"{r['records']:>9}{r['1 worker']:>11.2f}{r['2 workers']:>11.2f}"
              f"{r['2 always started']:>11.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "cpu": cpu_model(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
