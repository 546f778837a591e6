"""Reward models: the transformer trunk with one scalar head per domain (Bradley-Terry).

    make demo                                                 # writes runs/demo/{sft,preferences_*}
    posttrain train --config=configs/rm.py:tiny --workdir=runs/rm_tiny    # CPU, ~1 minute

A trained run is a reward function: register `rm:runs/rm_tiny` for a domain in a
`RewardRegistry` (see docs/rewards.md), or load it with `posttrain.train.load_reward_model`.

Presets:
  tiny           a reward model for the demo task, its trunk the SFT model of `make demo`,
                 trained on that model's right vs wrong answers (runs/demo/preferences_*.jsonl).
  llama3_8b_v5p  Llama 3.1 8B trunk (an SFT checkpoint or HF directory) on a v5p-64 slice.
Every field of configs/sft.py applies (model, data, optimizer, train, checkpoint, mesh), plus
`loss`. Records: {"prompt", "chosen", "rejected", "domain" (picks the head), "margin" (optional)}.
"""

import os

import ml_collections

from posttrain.config import load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(preset: str = "tiny") -> ml_collections.ConfigDict:
    if preset not in ("tiny", "llama3_8b_v5p"):
        raise ValueError(f"unknown rm preset {preset!r}: tiny, llama3_8b_v5p")
    # The tiny preset shares the demo's DPO data; the trunk, optimizer and mesh are SFT's.
    c = load_config_file(os.path.join(_HERE, "dpo.py") + ":" + preset)
    c.method = "rm"
    del c["loss"]
    c.loss = ml_collections.ConfigDict()
    c.loss.center_coefficient = 0.01  # (r_c + r_r)^2 weight: rewards stay near 0 (PPO-friendly)
    c.loss.use_margins = True  # subtract records' "margin" from r_c - r_r

    if preset == "tiny":
        c.optimizer.learning_rate = 1e-4
        c.optimizer.weight_decay = 0.0
        c.train.steps = 300
    elif preset == "llama3_8b_v5p":
        c.optimizer.learning_rate = 5e-6
        c.train.steps = 1000
    return c
