"""Asking before coding, on the tiny model: SFT on scripted `clarify` episodes, then GRPO with
the `clarify` environment (`posttrain.envs`).

`build_clarify_assets` writes a tokenizer learnt on the tasks' text, RL prompt files (train and
held-out tasks, disjoint draws) and SFT trajectories of other tasks: an `ask_share` of them ask
for what the request leaves out before the code, the rest guess it (their code is wrong where
a guess was). The warm start then asks some of the time; RL has to learn that asking pays.
`clarify_measure` samples held-out episodes and reports the reward, the tests passed, and the
questions asked (all, and those the request had answered).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.curate import train_tokenizer
from posttrain.envs import CLARIFY_SYSTEM, clarify_episode, clarify_tasks


def build_clarify_assets(
    out_dir: str | Path,
    *,
    n_train: int = 1200,
    n_eval: int = 48,
    n_sft: int = 1200,
    ask_share: float = 0.5,
    seed: int = 0,
) -> dict:
    """Writes `tokenizer/`, `train.jsonl` and `eval.jsonl` (clarify tasks, other seeds) and
    `sft.jsonl` (scripted episodes of yet other tasks, `ask_share` of them asking).

    Returns:
      {"tokenizer", "train", "eval", "sft"}: the paths.
    """
    out = Path(out_dir)
    held_out = clarify_tasks(n_eval, seed)
    train = clarify_tasks(n_train, seed + 1)
    rng = random.Random(seed + 3)
    sft = [clarify_episode(r, ask=rng.random() < ask_share)
           for r in clarify_tasks(n_sft, seed + 2)]  # fmt: skip
    texts = [m["content"] for e in sft for m in e["messages"]]
    texts += [r["prompt"] for r in train] + [CLARIFY_SYSTEM]
    paths = {"tokenizer": train_tokenizer(out / "tokenizer", texts)}
    for name, rows in (("train", train), ("eval", held_out), ("sft", sft)):
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def clarify_measure(model, tokenizer, records, *, samples: int = 4, temperature: float = 1.0,
                    max_turns: int = 4, turn_tokens: int = 96, seed: int = 0) -> dict:  # fmt: skip
    """Held-out clarify episodes sampled on the engine: the mean reward, share of tests passed,
    questions per episode, redundant questions per episode and the share that asked at all."""
    import jax
    import numpy as np

    from posttrain.envs import Budget, make_env, run_episodes
    from posttrain.sampling import Engine, EngineConfig

    engine = Engine(model, EngineConfig(slots=min(64, len(records) * samples)), max_len=512)
    groups = [[make_env("clarify", r) for _ in range(samples)] for r in records]
    budget = Budget(max_turns=max_turns, max_tokens=max_turns * turn_tokens,
                    turn_tokens=turn_tokens)  # fmt: skip
    episodes = [e for group in run_episodes(
        engine, tokenizer, groups, keys=jax.random.split(jax.random.key(seed), len(records)),
        temperature=temperature, budget=budget) for e in group]  # fmt: skip
    return {
        "reward": float(np.mean([e.reward or 0.0 for e in episodes])),
        "tests_passed": float(np.mean([e.counts.get("tests_passed", 0.0) for e in episodes])),
        "questions": float(np.mean([e.counts.get("questions", 0.0) for e in episodes])),
        "redundant": float(np.mean([e.counts.get("redundant_questions", 0.0) for e in episodes])),
        "asked": float(np.mean([e.counts.get("questions", 0.0) > 0 for e in episodes])),
    }


def run_clarify_demo(workdir: str = "runs/clarify", *, sft_overrides: dict | None = None,
                     rl_overrides: dict | None = None) -> dict:  # fmt: skip
    """Builds the assets in `workdir/assets`, warm-starts the tiny model with SFT
    (`configs/agent.py:clarify_sft`), then GRPO with the clarify environment
    (`configs/agent.py:clarify`); prints held-out reward, tests passed and questions before and
    after.

    Returns:
      {"sft": clarify_measure's dict, "rl": the same after GRPO, "eval_tasks", "sft_seconds",
      "rl_seconds"}.
    """
    import os

    from rich.console import Console
    from rich.table import Table

    from posttrain.data import load_tokenizer
    from posttrain.demo._stages import sft_then_grpo

    console = Console()
    assets = build_clarify_assets(os.path.join(workdir, "assets"))
    tokenizer = load_tokenizer(assets["tokenizer"])
    held_out = [json.loads(line) for line in open(assets["eval"])]
    source = {"weight": 1.0, "domain": "clarify", "format": "auto"}
    sft_values = {"tokenizer": assets["tokenizer"],
                  "data.sources": [{"path": assets["sft"], **source}]}  # fmt: skip
    rl_values = {"tokenizer": assets["tokenizer"],
                 "data.sources": [{"path": assets["train"], **source}]}  # fmt: skip
    runs = sft_then_grpo(
        workdir,
        ("clarify_sft", "clarify"),
        ({**sft_values, **(sft_overrides or {})}, {**rl_values, **(rl_overrides or {})}),
        lambda model: clarify_measure(model, tokenizer, held_out),
        ("SFT from scratch: {config.train.steps} steps on scripted episodes",
         "GRPO with the clarify environment: {config.train.steps} steps of "
         "{config.data.batch_size} tasks x {config.rollout.num_generations} episodes"),
        console,
    )  # fmt: skip
    before, after = runs["sft"], runs["rl"]
    sft_seconds, rl_seconds = runs["sft_seconds"], runs["rl_seconds"]

    table = Table(title=f"held-out tasks ({len(held_out)}), 4 episodes each at temperature 1")
    for column in ("stage", "reward", "tests passed", "asked", "questions", "redundant",
                   "train time"):  # fmt: skip
        table.add_column(column)
    for name, m, seconds in (("after SFT", before, sft_seconds), ("SFT + GRPO", after, rl_seconds)):
        table.add_row(name, f"{m['reward']:.3f}", f"{100 * m['tests_passed']:.1f}%",
                      f"{100 * m['asked']:.1f}%", f"{m['questions']:.2f}", f"{m['redundant']:.2f}",
                      f"{seconds:.0f}s")  # fmt: skip
    console.print(table)
    return {"sft": before, "rl": after, "eval_tasks": len(held_out), "sft_seconds": sft_seconds,
            "rl_seconds": rl_seconds}  # fmt: skip
