"""The calculator task: multiplications the tiny model cannot do alone, and a tool that can.

A problem is "What is 347 * 589?" (domain "arithmetic", answer "204383"); the `calculator`
environment (`posttrain.envs`) offers the `calculate` tool. A solved episode is three turns:

    assistant: <tool_call>{"name": "calculate", "arguments": {"expression": "347 * 589"}}
               </tool_call>
    tool:      204383
    assistant: 204383

`build_calculator_assets` writes what a run needs: the demo tokenizer with a compact
Hermes-style chat template that renders tools and tool calls (short enough for the tiny
model's context), RL prompt files, and SFT trajectories of solved episodes (with `tools`, for
a warm start that teaches the call format on a few examples).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from posttrain.curate import TOOL_CHAT_TEMPLATE as CALCULATOR_TEMPLATE
from posttrain.data import tool_schema
from posttrain.demo._assets import ASSETS_DIR
from posttrain.envs import CALCULATOR_SYSTEM, calculate

_QUESTION = "What is {a} * {b}?"


def make_problems(n: int, seed: int, *, digits: int = 3, exclude=()) -> list[dict]:
    """`n` distinct multiplication problems of two `digits`-digit numbers (not in `exclude`)."""
    rng = random.Random(seed)
    seen = {r["prompt"] for r in exclude}
    out = []
    lo, hi = 10 ** (digits - 1), 10**digits - 1
    while len(out) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        prompt = _QUESTION.format(a=a, b=b)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(a * b), "domain": "arithmetic"})
    return out


def solved_episode(record: dict, *, use_tool: bool = True) -> dict:
    """The SFT record of a solved episode of `record` (with tools): a tool call, its result and
    the answer, or (`use_tool=False`) the answer straight away."""
    opening = [
        {"role": "system", "content": CALCULATOR_SYSTEM},
        {"role": "user", "content": record["prompt"]},
    ]
    answer = {"role": "assistant", "content": record["answer"]}
    tools = [tool_schema(calculate)]
    if not use_tool:
        return {"messages": [*opening, answer], "tools": tools}
    expression = record["prompt"].removeprefix("What is ").removesuffix("?")
    function = {"name": "calculate", "arguments": {"expression": expression}}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": function}],
    }
    result = {"role": "tool", "content": calculate(expression)}
    return {"messages": [*opening, call, result, answer], "tools": tools}


def build_calculator_assets(
    out_dir: str | Path,
    *,
    n_train: int = 2000,
    n_eval: int = 64,
    n_sft: int = 1024,
    tool_share: float = 0.5,
    digits: int = 3,
    seed: int = 0,
) -> dict[str, str]:
    """Writes `tokenizer/` (the demo tokenizer with `CALCULATOR_TEMPLATE`), `train.jsonl` and
    `eval.jsonl` (RL prompts, disjoint) and `sft.jsonl`: episodes of other problems, a
    `tool_share` of them calling the tool and the rest answering at once (right answers the
    tiny model cannot learn to compute), so the warm-started model uses the tool only some of
    the time and RL has something to learn: that calling it pays.

    Returns:
      {"tokenizer": dir, "train": path, "eval": path, "sft": path}.
    """
    out = Path(out_dir)
    tokenizer = out / "tokenizer"
    shutil.copytree(ASSETS_DIR / "tokenizer", tokenizer, dirs_exist_ok=True)
    config_path = tokenizer / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CALCULATOR_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    held_out = make_problems(n_eval, seed, digits=digits)
    train = make_problems(n_train, seed + 1, digits=digits, exclude=held_out)
    rng = random.Random(seed + 3)
    sft = [
        solved_episode(r, use_tool=rng.random() < tool_share)
        for r in make_problems(n_sft, seed + 2, digits=digits, exclude=held_out + train)
    ]
    paths = {"tokenizer": str(tokenizer)}
    for name, rows in (("train", train), ("eval", held_out), ("sft", sft)):
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def calculator_success(model, tokenizer, records, *, temperature: float = 0.0, samples: int = 1):
    """(success rate, tool-call rate) of calculator episodes on `records` (greedy by default)."""
    import jax
    import numpy as np

    from posttrain.envs import Budget, make_env, run_episodes
    from posttrain.rewards import integer_correct
    from posttrain.sampling import Engine, EngineConfig

    engine = Engine(model, EngineConfig(slots=min(64, len(records) * samples)), max_len=320)
    groups = [[make_env("calculator", r) for _ in range(samples)] for r in records]
    keys = jax.random.split(jax.random.key(0), len(records))
    budget = Budget(max_turns=3, max_tokens=128, turn_tokens=96)
    episodes = run_episodes(
        engine, tokenizer, groups, keys=keys, temperature=temperature, budget=budget
    )
    pairs = [(r, e) for r, group in zip(records, episodes, strict=True) for e in group]
    solved = np.mean([integer_correct(e.text, r) for r, e in pairs])
    return float(solved), float(np.mean([e.tool_calls > 0 for _, e in pairs]))


def _measure(model, tokenizer, records) -> dict:
    """Success and tool use sampled as in training (temperature 1, 8 per problem), and greedy."""
    success, tool_rate = calculator_success(model, tokenizer, records, temperature=1.0, samples=8)
    greedy, _ = calculator_success(model, tokenizer, records)
    return {"success": success, "tool_rate": tool_rate, "greedy_success": greedy}


def run_calculator_demo(
    workdir: str = "runs/agent", *, sft_overrides: dict | None = None, rl_overrides=None
) -> dict:
    """Builds the task's assets in `workdir/assets`, warm-starts the tiny model with SFT
    (`configs/agent.py:calculator_sft`), then GRPO with the calculator environment
    (`configs/agent.py:calculator`); prints held-out success and tool use before and after.

    Returns:
      {"sft": {"success", "tool_rate", "greedy_success"}, "rl": {...}, "eval_problems",
      "sft_seconds", "rl_seconds"}.
    """
    import os

    from rich.console import Console
    from rich.table import Table

    from posttrain.data import load_tokenizer
    from posttrain.demo._stages import sft_then_grpo

    console = Console()
    assets = build_calculator_assets(os.path.join(workdir, "assets"))
    tokenizer = load_tokenizer(assets["tokenizer"])
    held_out = [json.loads(line) for line in open(assets["eval"])]

    def source(path, domain):
        return {"path": path, "weight": 1.0, "domain": domain, "format": "auto"}

    sft_values = {"tokenizer": assets["tokenizer"], "data.sources": [source(assets["sft"], "calc")]}
    rl_values = {
        "tokenizer": assets["tokenizer"],
        "data.sources": [source(assets["train"], "arithmetic")],
        "eval_data": [source(assets["eval"], "arithmetic")],
    }
    runs = sft_then_grpo(
        workdir,
        ("calculator_sft", "calculator"),
        ({**sft_values, **(sft_overrides or {})}, {**rl_values, **(rl_overrides or {})}),
        lambda model: _measure(model, tokenizer, held_out),
        ("SFT from scratch: {config.train.steps} steps on solved episodes",
         "GRPO with the calculator: {config.train.steps} steps of {config.data.batch_size} "
         "problems x {config.rollout.num_generations} episodes"),
        console,
    )  # fmt: skip
    before, after = runs["sft"], runs["rl"]
    sft_seconds, rl_seconds = runs["sft_seconds"], runs["rl_seconds"]

    table = Table(title=f"held-out problems ({len(held_out)})")
    columns = ("stage", "solved, sampled", "tool use, sampled", "solved, greedy", "train time")
    for column in columns:
        table.add_column(column)
    for name, m, seconds in (("after SFT", before, sft_seconds), ("SFT + GRPO", after, rl_seconds)):
        table.add_row(
            name,
            *(f"{100 * m[k]:.1f}%" for k in ("success", "tool_rate", "greedy_success")),
            f"{seconds:.0f}s",
        )
    console.print(table)
    console.print("sampled: 8 episodes per problem at temperature 1, as in training")
    return {
        "sft": before,
        "rl": after,
        "eval_problems": len(held_out),
        "sft_seconds": sft_seconds,
        "rl_seconds": rl_seconds,
    }
