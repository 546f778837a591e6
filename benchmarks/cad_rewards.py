"""CAD reward throughput: 256 completions (reference scripts of generated tasks, levels 1-3 in
turn, every third one perturbed: its first cutting line cuts nothing) scored by the `cad` domain
on the reward pool, each script in its own sandbox, then the part built and measured by
manifold3d.

    python benchmarks/cad_rewards.py --completions=256 --workers=2

Reports wall-clock seconds for the batch (after the pool's warm-up), completions per second,
the mean score, and checks that a second pass gives the same scores (determinism).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _machine import cpu_model  # benchmarks/ is the script directory

from posttrain.rewards import RewardPool, cad_sft_record, default_registry, make_cad_task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    tasks = [make_cad_task(i, 1 + i % 3) for i in range(args.completions)]
    completions = []
    for i, task in enumerate(tasks):
        answer = cad_sft_record(task)["messages"][1]["content"]
        if i % 3 == 2:  # holes left out: the first cutting line cuts nothing
            answer = answer.replace("part = part - ", "part = part if True else part - ", 1)
        completions.append(answer)
    with RewardPool(default_registry(), workers=args.workers, timeout_s=30) as pool:
        pool.score(tasks[:2], completions[:2])  # warm-up: workers started, imports done
        start = time.perf_counter()
        first = pool.score(tasks, completions)
        seconds = time.perf_counter() - start
        second = pool.score(tasks, completions)
    scores = [r.score for r in first]
    result = {
        "benchmark": "cad_rewards",
        "cpu": cpu_model(),
        "completions": len(tasks),
        "workers": args.workers,
        "seconds": round(seconds, 2),
        "completions_per_s": round(len(tasks) / seconds, 1),
        "mean_score": round(sum(scores) / len(scores), 4),
        "statuses": sorted({r.status for r in first}),
        "deterministic": scores == [r.score for r in second],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
