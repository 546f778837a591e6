"""RL steps per second on the tiny config, and where the time goes (generate / score / train).

Runs `configs/grpo.py:tiny` (or `--preset`, e.g. dapo_tiny) for `--steps` RL steps on the
bundled arithmetic prompts with the demo verifier as the reward, starting from `--checkpoint`
(default: a random tiny model), and reports the mean step time after `--warmup` steps (compiles
excluded) split into rollout generation, reward scoring (the verifier in worker processes), the
trainer's log-prob passes and advantages, and the optimizer updates.

    python benchmarks/rl_throughput.py --steps=40 --warmup=5
    python benchmarks/rl_throughput.py --checkpoint=runs/demo/sft --engines=paged,padded

Each engine shape in `--engines` runs the same steps in turn, so their step times are side by
side in one run: "paged" is `rollout.engine` as configured (the default: continuous batching,
prefix sharing), "padded" the old static sampler's shape (one KV block per row, no prefix
sharing, one decode call for the whole completion).

Reported in docs/benchmarks.md; raw numbers in benchmarks/results/rl_throughput_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import tempfile

import jax
import numpy as np

from posttrain.config import load_config_file
from posttrain.demo import ASSETS_DIR
from posttrain.methods import run_from_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rollout.engine settings of each `--engines` name, from the rollout section.
SHAPES = {
    "paged": lambda r: {},
    "padded": lambda r: {
        "block_size": r.max_prompt_len + r.max_new_tokens,
        "prefix_sharing": False,
        "chunk": r.max_new_tokens,
    },
}


def _measure(config, args, engine: str) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        run_from_config(config, workdir, on_metrics=lambda step, m: rows.append(m))
    timed = rows[args.warmup :]
    names = ("generate_s", "reward_s", "prepare_s", "train_s")
    parts = {k: float(np.mean([r[k] for r in timed])) for k in names}
    step_s = float(np.mean([r["step_s"] for r in timed]))
    return {
        "preset": args.preset,
        "engine": engine,
        "checkpoint": args.label or args.checkpoint or "random init",
        "prompts_per_step": config.data.batch_size,
        "samples_per_prompt": config.rollout.num_generations,
        "max_new_tokens": config.rollout.max_new_tokens,
        "steps_timed": len(timed),
        "step_s": step_s,
        "steps_per_s": 1.0 / step_s,
        "rollouts_per_s": config.data.batch_size * config.rollout.num_generations / step_s,
        **parts,
        "share": {k: v / step_s for k, v in parts.items()},
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--checkpoint", default="", help="start from this run (default: random)")
    parser.add_argument("--label", default="", help="what to call the checkpoint in the results")
    parser.add_argument("--engines", default="paged", help="comma-separated: paged,padded")
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks/results/rl_throughput_cpu.json")
    )
    args = parser.parse_args()

    config = load_config_file(os.path.join(REPO, "configs", "grpo.py") + ":" + args.preset)
    config.model.checkpoint = args.checkpoint
    config.tokenizer = str(ASSETS_DIR / "tokenizer")
    config.eval_data = []
    config.train.steps, config.train.progress, config.train.eval_every = args.steps, False, 0
    config.checkpoint.every = 10 * args.steps
    config.mesh.ici = {"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
    results = {}
    for engine in args.engines.split(","):
        if engine not in SHAPES:
            parser.error(f"--engines: {engine!r} is not one of {sorted(SHAPES)}")
        run = copy.deepcopy(config)
        run.rollout.engine.update(SHAPES[engine](run.rollout))
        results[engine] = _measure(run, args, engine)
    result = results[engine] if len(results) == 1 else results
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
