"""posttrain's side of benchmarks/rl_vs_peers.py: configs/grpo.py on the shared task.

The spec's HF directory is the model (`model.hf_path`) and tokenizer, its prompt strings the
data (in order, no shuffling), `_rl_task.digit_share` the reward (in the reward worker pool, as
a run scores), one GRPO update per step on every completion, no KL, AdamW at a constant rate,
the default paged engine for rollouts, one CPU device. The split comes from the run's own
metrics: generate_s, reward_s, and train_s = the trainer's log-prob pass + advantages
(prepare_s) + the update.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/_grpo_posttrain.py --spec S --out R
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import _rl_task


def digit_reward(record, completion: str) -> tuple[float, dict]:
    """The shared reward in posttrain's `(record, completion) -> (score, info)` signature."""
    return _rl_task.digit_share(completion), {}


def config_for(spec: dict, folder: str):
    from posttrain.config import load_config_file, override

    data = os.path.join(folder, "prompts.jsonl")
    with open(data, "w") as f:
        for prompt in spec["prompts"]:
            f.write(json.dumps({"prompt": prompt, "domain": "digits"}) + "\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = load_config_file(os.path.join(repo, "configs", "grpo.py") + ":tiny")
    return override(config, {
        "model.checkpoint": "",
        "model.hf_path": spec["model_dir"],
        "tokenizer": spec["model_dir"],
        "data.sources": [{"path": data, "weight": 1.0, "domain": "digits", "format": "auto"}],
        "data.shuffle": False,
        "eval_data": [],
        "data.batch_size": spec["prompts_per_step"],
        "rollout.num_generations": spec["group_size"],
        "rollout.max_new_tokens": spec["max_new_tokens"],
        "rollout.max_prompt_len": spec["max_prompt_tokens"],
        "rollout.sampling.temperature": spec["temperature"],
        "rewards.domains": {"digits": ["_grpo_posttrain:digit_reward"]},
        "rewards.workers": 1,
        "optimizer.learning_rate": spec["learning_rate"],
        "optimizer.warmup_steps": 0,
        "optimizer.schedule": "constant",
        "optimizer.weight_decay": 0.0,
        "optimizer.b2": 0.999,  # torch's and optax's AdamW default, as the peers run
        "optimizer.grad_clip": 0.0,
        "kl.coef": 0.0,
        "train.steps": spec["steps"],
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.progress": False,
        "train.seed": spec["seed"],
        "checkpoint.every": 10 * spec["steps"],
        "mesh.ici": {"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", default="{}", help="config overrides (JSON), a lever to measure")
    parser.add_argument("--devices", type=int, default=1, help="CPU devices (decoupled: 2)")
    args = parser.parse_args()
    spec = _rl_task.read_spec(args.spec)
    if args.devices > 1:  # (before jax is imported)
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"

    import jax
    import numpy as np

    import posttrain
    from posttrain.config import override
    from posttrain.methods import run_from_config

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = override(config_for(spec, folder), json.loads(args.set))
        run_from_config(config, os.path.join(folder, "run"), on_metrics=lambda s, m: rows.append(m))
    assert len(rows) == spec["steps"], len(rows)
    timed = rows[spec["warmup"] :]
    mean = lambda key: float(np.mean([r[key] for r in timed]))  # noqa: E731
    completions = spec["prompts_per_step"] * spec["group_size"]
    _rl_task.write_result(args.out, {
        "implementation": "posttrain GRPO",
        "version": f"posttrain {posttrain.__version__}, jax {jax.__version__}",
        "steps_timed": len(timed),
        "step_s": mean("step_s"),
        "generate_s": mean("generate_s"),
        "reward_s": mean("reward_s"),
        "train_s": mean("prepare_s") + mean("train_s"),
        "trainer_pass_s": mean("prepare_s"),  # (of train_s: the old-log-prob pass, advantages)
        "completion_tokens": mean("response_length") * completions,
        "rewards": [r["reward"] for r in rows],
        "settings": json.loads(args.set),
        "notes": "paged engine (64 slots, prefix sharing); reward in 1 worker process; "
                 "train_s = the trainer's pass (unless fused) + advantages + one update",
    })  # fmt: skip


if __name__ == "__main__":
    main()
