"""CAD: a tiny model learns to write CAD scripts (docs/cad.md).

    posttrain demo --task=cad                                                 # CPU, minutes

Presets:
  sft   the tiny model from scratch on the task generator's reference scripts (plates,
        flanges, gears, brackets and enclosures, levels 1-3), one chat per task: description
        in, parametric script out; the demo's chats leave cad.show out of half the scripts
        (flawed data GRPO then fixes, docs/cad.md).
  grpo  GRPO from sft's run (runs/cad/sft) on 1000 other tasks, reward = the `cad` domain
        (validity, IoU with the target, dimensions, holes, one body, stability, required
        features; gated unless the assets were built with aggregate="mean"); eval on 64
        held-out tasks, greedy.
Both read runs/cad/assets (written by `posttrain demo --task=cad`, or
posttrain.curate.build_cad_assets). Every field of configs/sft.py / configs/grpo.py applies.
"""

import os

from posttrain.config import load_config_file, override

_HERE = os.path.dirname(os.path.abspath(__file__))
_ASSETS = os.path.join("runs", "cad", "assets")
PRESETS = ("sft", "grpo")


def _source(name):
    return {"path": os.path.join(_ASSETS, name), "weight": 1.0, "domain": "cad", "format": "auto"}


def get_config(preset: str = "grpo"):
    if preset not in PRESETS:
        raise ValueError(f"unknown cad preset {preset!r}: {', '.join(PRESETS)}")
    if preset == "sft":
        c = load_config_file(os.path.join(_HERE, "sft.py") + ":tiny")
        return override(
            c,
            {
                "tokenizer": os.path.join(_ASSETS, "tokenizer"),
                "data.sources": [_source("sft.jsonl")],
                "eval_data": [],
                "data.max_len": 400,  # a chat is up to ~395 tokens (gears)
                "data.batch_size": 32,
                "train.steps": 400,
                "train.log_every": 20,
                "train.eval_every": 0,
                "checkpoint.every": 200,
                "optimizer.warmup_steps": 30,
            },
        )
    c = load_config_file(os.path.join(_HERE, "grpo.py") + ":tiny")
    return override(
        c,
        {
            "model.checkpoint": os.path.join("runs", "cad", "sft"),
            "tokenizer": os.path.join(_ASSETS, "tokenizer"),
            "data.sources": [_source("train.jsonl")],
            "eval_data": [_source("eval.jsonl")],
            "data.batch_size": 8,
            "rollout.num_generations": 8,
            "rollout.max_prompt_len": 144,  # task descriptions are up to ~134 tokens
            "rollout.max_new_tokens": 288,  # answers up to ~274 tokens (gears)
            "rewards.pass_threshold": 0.99,
            "rewards.workers": 2,
            "optimizer.learning_rate": 1e-4,
            "optimizer.warmup_steps": 5,
            "train.steps": 40,
            "train.log_every": 1,
            "train.eval_every": 20,
            "checkpoint.every": 20,
        },
    )
