"""A toy verifiable task for RL tests: the demo problems as prompts (domain "arithmetic"), scored
by a dense reward instead of the verifier (the share of the completion's characters that are
digits), which a random tiny model can climb."""

import os

from posttrain.config import load_config_file, override
from posttrain.demo import ASSETS_DIR

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digit_share(record, completion: str):
    """Reward in [0, 1]: the share of the completion's characters that are digits (also
    reported as the reward's one named component, which RL logs per domain)."""
    text = completion.strip()
    share = sum(ch.isdigit() for ch in text) / len(text) if text else 0.0
    return share, {"components": {"digits": share}}


def toy_config(preset: str = "tiny", file: str = "grpo.py", **overrides):
    """configs/<file>:<preset> shrunk to seconds: a random tiny model, the digit reward."""
    config = load_config_file(os.path.join(REPO, "configs", file) + ":" + preset)
    values = {
        "model.checkpoint": "",
        "tokenizer": str(ASSETS_DIR / "tokenizer"),
        "data.sources": [
            {
                "path": str(ASSETS_DIR / "train.jsonl"),
                "weight": 1.0,
                "domain": "arithmetic",
                "format": "auto",
            }
        ],  # fmt: skip
        "eval_data": [],
        "data.batch_size": 8,
        "rollout.num_generations": 8,
        "rollout.max_new_tokens": 6,
        "rewards.domains": {"arithmetic": ["tests.rl.toy:digit_share"]},
        "rewards.workers": 1,
        "rewards.pass_threshold": 0.5,
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_steps": 0,
        "train.steps": 20,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.progress": False,
        "checkpoint.every": 100,
        "mesh.ici": {"data": -1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
        **{k.replace("__", "."): v for k, v in overrides.items()},
    }
    return override(config, values)


def always_one(record, completion: str):
    """A domain every completion solves: its groups carry no learning signal."""
    return 1.0, {}


def two_domain_prompts(path, n: int = 256) -> str:
    """Demo problems split into a "digits" domain (`digit_share`) and a "solved" one
    (`always_one`), written as a prompt file."""
    import json

    with open(ASSETS_DIR / "train.jsonl") as f:
        records = [json.loads(line) for _, line in zip(range(n), f, strict=False)]
    with open(path, "w") as f:
        for i, r in enumerate(records):
            r["domain"] = "digits" if i % 2 else "solved"
            f.write(json.dumps(r) + "\n")
    return str(path)


TWO_DOMAIN_REWARDS = {"digits": ["tests.rl.toy:digit_share"], "solved": ["tests.rl.toy:always_one"]}


def no_letters(record, completion: str):
    """Reward in [0, 1]: the share of the completion's characters that are not letters (a second
    learnable domain that digits also satisfy)."""
    text = completion.strip()
    return (sum(not ch.isalpha() for ch in text) / len(text) if text else 0.0), {}


LEARNABLE_REWARDS = {"digits": ["tests.rl.toy:digit_share"], "solved": ["tests.rl.toy:no_letters"]}
