"""The RL workload benchmarks/rl_vs_peers.py gives posttrain, TRL and Tunix: one tiny Llama in an
HF directory, the demo's arithmetic questions as chat-rendered prompt strings, and a reward every
implementation computes with the same plain function. Imports nothing outside the standard
library (each peer runs this under its own venv)."""

from __future__ import annotations

import json

SPEC_KEYS = (
    "model_dir",  # HF LlamaForCausalLM (safetensors) + its tokenizer files
    "prompts",  # prompt strings (chat template already applied), drawn in order, cycling
    "prompts_per_step",  # distinct prompts per RL step
    "group_size",  # completions per prompt
    "max_new_tokens",  # completion budget
    "max_prompt_tokens",  # the longest prompt, in tokens (for static KV caches)
    "temperature",
    "learning_rate",  # AdamW, constant, no warmup, no weight decay, no clipping
    "steps",  # RL steps in all, each one optimizer update on all its completions
    "warmup",  # the first steps, excluded from the means (they compile)
    "seed",
    "threads",  # CPU threads each implementation may use
)


def digit_share(completion: str) -> float:
    """Reward in [0, 1]: the share of the completion's characters that are digits (a random
    model can climb it, so advantages are not all zero)."""
    text = completion.strip()
    return sum(ch.isdigit() for ch in text) / len(text) if text else 0.0


def read_spec(path: str) -> dict:
    with open(path) as f:
        spec = json.load(f)
    missing = [k for k in SPEC_KEYS if k not in spec]
    if missing:
        raise SystemExit(f"{path}: the spec lacks {missing}")
    return spec


def write_result(path: str, result: dict) -> None:
    """A worker's result. Keys: implementation, version, steps_timed, step_s, generate_s,
    reward_s, train_s (each a mean over the timed steps, seconds), completion_tokens (mean
    sampled tokens per step, up to and including EOS), rewards (mean reward of every step),
    notes (free text: what differs from the spec)."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
