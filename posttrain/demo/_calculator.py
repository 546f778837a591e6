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

from posttrain.data import tool_schema
from posttrain.demo._assets import ASSETS_DIR
from posttrain.envs import calculate
from posttrain.envs._builtin import CALCULATOR_SYSTEM

# ChatML with tools (a "Tool:" line per tool in the system turn), assistant tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (the "hermes" format) and tool
# results as their own turns.
CALCULATOR_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.first = 1 %}{%- endif %}"
    "{%- if tools or ns.first %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if ns.first %}{{- messages[0]['content'] }}{%- endif %}"
    "{%- for tool in tools or [] %}"
    "{{- '\\nTool: ' + tool['function']['name'] + ' - ' + tool['function']['description'] }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

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


def solved_episode(record: dict) -> dict:
    """The SFT record of a solved episode of `record` (messages with a tool call, and tools)."""
    expression = record["prompt"].removeprefix("What is ").removesuffix("?")
    call = {"name": "calculate", "arguments": {"expression": expression}}
    return {
        "messages": [
            {"role": "system", "content": CALCULATOR_SYSTEM},
            {"role": "user", "content": record["prompt"]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": call}],
            },
            {"role": "tool", "content": calculate(expression)},
            {"role": "assistant", "content": record["answer"]},
        ],
        "tools": [tool_schema(calculate)],
    }


def build_calculator_assets(
    out_dir: str | Path, *, n_train: int = 2000, n_eval: int = 64, n_sft: int = 1024, seed: int = 0
) -> dict[str, str]:
    """Writes `tokenizer/` (the demo tokenizer with `CALCULATOR_TEMPLATE`), `train.jsonl` and
    `eval.jsonl` (RL prompts, disjoint) and `sft.jsonl` (solved episodes of other problems).

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
    held_out = make_problems(n_eval, seed)
    train = make_problems(n_train, seed + 1, exclude=held_out)
    sft = [solved_episode(r) for r in make_problems(n_sft, seed + 2, exclude=held_out + train)]
    paths = {"tokenizer": str(tokenizer)}
    for name, rows in (("train", train), ("eval", held_out), ("sft", sft)):
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths
