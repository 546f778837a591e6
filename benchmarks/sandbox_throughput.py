"""Sandboxed executions per second vs a plain unsandboxed subprocess, same pool, same program.

Each side runs `print(1)` `--runs` times on a pool of `--workers` threads: the sandbox through
`SandboxPool` (a fresh bwrap container, rlimits, capped output per run), the baseline through
`subprocess.run([python, "-c", "print(1)"], capture_output=True)` with the same interpreter
(the system Python the sandbox uses). Rounds alternate between the two so load drifts hit both.

    python benchmarks/sandbox_throughput.py --runs=200 --workers=2 --rounds=3

Reported in docs/benchmarks.md; the target is sandbox overhead <= 2x the plain subprocess.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.rewards import sandbox

PROGRAM = "print(1)"


def time_plain(argv: list[str], runs: int, workers: int) -> float:
    """Seconds for `runs` plain subprocess runs of argv on `workers` threads."""

    def one(_):
        out = subprocess.run(argv, capture_output=True, check=True)
        assert out.stdout == b"1\n"

    with ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        list(pool.map(one, range(runs)))
        return time.perf_counter() - start


def time_sandbox(runs: int, workers: int) -> float:
    """Seconds for `runs` sandboxed runs on a `SandboxPool(workers)`."""
    with sandbox.SandboxPool(workers, timeout_s=10, memory_mb=256) as pool:
        start = time.perf_counter()
        results = pool.map([PROGRAM] * runs)
        elapsed = time.perf_counter() - start
    assert all(r.stdout == "1\n" and r.exit_code == 0 for r in results), results[0]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="executions per measurement")
    parser.add_argument("--workers", type=int, default=2, help="concurrent executions")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; best is kept")
    args = parser.parse_args()

    python = sandbox.interpreter()
    sides = {
        f"plain subprocess (`{python} -c`)": lambda: time_plain(
            [python, "-c", PROGRAM], args.runs, args.workers
        ),
        f"plain subprocess (`{python} -I -S -c`)": lambda: time_plain(
            [python, "-I", "-S", "-c", PROGRAM], args.runs, args.workers
        ),
        "sandbox (bwrap)": lambda: time_sandbox(args.runs, args.workers),
    }
    for fn in sides.values():  # warm up: page cache, bwrap's one-time probe
        fn()
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(args.rounds):
        for name, fn in sides.items():
            best[name] = min(best[name], fn())

    baseline = next(iter(best.values()))
    print(f"{args.runs} runs of `{PROGRAM}`, pool of {args.workers}, best of {args.rounds}\n")
    print("| runner | executions/s | ms per execution (per worker) | time vs plain `-c` |")
    print("|---|---|---|---|")
    for name, seconds in best.items():
        per_run_ms = 1000 * seconds * args.workers / args.runs
        rate = args.runs / seconds
        print(f"| {name} | {rate:.0f} | {per_run_ms:.1f} | {seconds / baseline:.2f}x |")


if __name__ == "__main__":
    main()
