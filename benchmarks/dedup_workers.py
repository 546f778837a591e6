"""When `posttrain data dedup`'s workers pay: the whole dedup of a synthetic corpus (the one
`dedup_throughput.py` writes) with 1 worker and with 2 (the first chunk is timed here and
workers start only when the rest would pay for them), optionally with 2 in another checkout
(`--baseline`, e.g. one from before that rule, which started them for any input of two or more
chunks), plus what a pool of 2 spawned workers takes to start.

    git worktree add /tmp/before 77001e4
    python benchmarks/dedup_workers.py --records=3000 --records=100000 --baseline=/tmp/before

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
    """Seconds from starting a spawned pool to every worker having answered, each having
    imported posttrain.curate first (as a dedup worker does when it unpickles its function)."""
    import importlib

    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, importlib.import_module, ("posttrain.curate",)) as pool:
        pids = set()
        while len(pids) < workers:
            pids.update(pool.map(_noop, range(4 * workers), chunksize=1))
    queue.put(time.perf_counter() - t0)


def _dedup(path: str, workers: int, checkout: str, queue) -> None:
    if checkout:
        sys.path.insert(0, checkout)
    from posttrain.curate import dedup

    t0 = time.perf_counter()
    dedup([path], path + ".out.jsonl", workers=workers, progress=False)
    queue.put(time.perf_counter() - t0)


def _fresh(fn, *args) -> float:
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=fn, args=(*args, queue))
    process.start()
    while True:
        try:
            value = queue.get(timeout=1.0)
            break
        except Exception:  # queue.Empty: still working, unless it died
            if not process.is_alive():
                raise RuntimeError(f"{fn.__name__} failed (exit {process.exitcode})") from None
    process.join()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, action="append")
    parser.add_argument("--baseline", default="", help="another checkout's root, for a column")
    parser.add_argument("--json", default="benchmarks/results/dedup_workers_cpu.json")
    args = parser.parse_args()
    results = {"pool start, 2 workers (s)": _fresh(_pool_start, 2), "runs": []}
    results["baseline"] = args.baseline
    with tempfile.TemporaryDirectory() as tmp:
        for records in args.records or [3000, 100_000]:
            path = os.path.join(tmp, f"corpus{records}.jsonl")
            _write_corpus(path, records, 0)
            row = {"records": records}
            runs = [("1 worker", 1, ""), ("2 workers", 2, "")]
            if args.baseline:
                runs.append(("2 workers, baseline", 2, os.path.abspath(args.baseline)))
            for name, workers, checkout in runs:
                row[name] = _fresh(_dedup, path, workers, checkout)
            results["runs"].append(row)
    command = "python " + " ".join(sys.argv)
    print(f"{command}\n{cpu_model()}")
    print(f"pool start, 2 spawned workers: {results['pool start, 2 workers (s)']:.1f} s")
    print(f"{'records':>9}{'1 worker':>11}{'2 workers':>11}{'baseline 2':>12}   (seconds)")
    for r in results["runs"]:
        base = f"{r['2 workers, baseline']:>12.2f}" if args.baseline else ""
        print(f"{r['records']:>9}{r['1 worker']:>11.2f}{r['2 workers']:>11.2f}{base}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "cpu": cpu_model(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
