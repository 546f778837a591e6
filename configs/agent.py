"""Agentic RL: multi-turn episodes with tools (docs/agents.md).

    posttrain demo --task=calculator                                          # CPU, minutes
    posttrain train --config=configs/agent.py:python_tool_qwen25_7b --workdir=runs/pytool

Presets:
  calculator_sft         warm start of the tiny model on solved calculator episodes (tool calls
                         in the chat template; assistant-only loss), from scratch: half call
                         the tool, half answer at once.
  calculator             GRPO on 3-digit multiplications with the `calculate` tool, from
                         calculator_sft's run (runs/agent/sft); the answer's verifier is the reward.
  calculator_faults      calculator with 30% of tool calls failing (timeouts, errors, empty
                         results).
  python_tool_qwen25_7b  GRPO for Qwen2.5-7B-Instruct with a sandboxed Python tool on math
                         prompts (set model.hf_path and data.sources); v5p-64.
  terminal_qwen25_7b     the terminal environment (bash and file tools in a per-episode sandboxed
                         workspace, reward = hidden tests) on the bundled tasks.
  clarify_sft            warm start of the tiny model on scripted `clarify` episodes (incomplete
                         coding requests): half ask for what is missing, half guess.
  clarify                GRPO with the `clarify` environment (a scripted user, hidden tests, a cost
                         per question) from clarify_sft's run (runs/clarify/sft).
  retrieval_sft          warm start of the tiny model on scripted `retrieval` episodes (search,
                         quote the evidence, answer) about documents longer than its window.
  retrieval              GRPO with the `retrieval` environment (grounded_qa reward) from
                         retrieval_sft's run (runs/retrieval/search/sft).
  truncated_sft          the same questions, answered from the document truncated to the window.
  truncated              GRPO on them from truncated_sft's run (runs/retrieval/truncated/sft).
The calculator presets read runs/agent/assets (written by `posttrain demo --task=calculator`,
or posttrain.demo.build_calculator_assets), the clarify ones runs/clarify/assets
(posttrain.demo.build_clarify_assets), the retrieval and truncated ones runs/retrieval/assets
(`posttrain demo --task=retrieval`). Every field of configs/grpo.py applies.
"""

import os

from posttrain.config import load_config_file, override

_HERE = os.path.dirname(os.path.abspath(__file__))
_ASSETS = os.path.join("runs", "agent", "assets")
_TASKS = os.path.join(_HERE, "..", "posttrain", "envs", "assets", "terminal_tasks.jsonl")
PRESETS = (
    "calculator_sft",
    "calculator",
    "calculator_faults",
    "python_tool_qwen25_7b",
    "terminal_qwen25_7b",
    "clarify_sft",
    "clarify",
    "retrieval_sft",
    "retrieval",
    "truncated_sft",
    "truncated",
)
_CLARIFY = os.path.join("runs", "clarify")
_RETRIEVAL = os.path.join("runs", "retrieval")


def _source(path, domain):
    return {"path": path, "weight": 1.0, "domain": domain, "format": "auto"}


def _tiny_sft(assets: str, file: str, domain: str, values: dict):
    """configs/sft.py:tiny from scratch on a demo's SFT episodes (`assets`/`file`, with the
    demo's tokenizer), and `values`."""
    return override(
        load_config_file(os.path.join(_HERE, "sft.py") + ":tiny"),
        {
            "tokenizer": os.path.join(assets, "tokenizer"),
            "data.sources": [_source(os.path.join(assets, file), domain)],
            "eval_data": [],
            "data.batch_size": 16,
            "train.steps": 600,
            "train.log_every": 20,
            "train.eval_every": 0,
            "checkpoint.every": 300,
            "optimizer.warmup_steps": 20,
            **values,
        },
    )


def _tiny_grpo(start: str, assets: str, file: str, domain: str, values: dict):
    """configs/grpo.py:tiny from the SFT run `start` on a demo's RL prompts (`assets`/`file`):
    8 prompts x 8 samples a step at temperature 1, and `values`."""
    return override(
        load_config_file(os.path.join(_HERE, "grpo.py") + ":tiny"),
        {
            "model.checkpoint": start,
            "tokenizer": os.path.join(assets, "tokenizer"),
            "data.sources": [_source(os.path.join(assets, file), domain)],
            "eval_data": [],
            "data.batch_size": 8,
            "rollout.num_generations": 8,
            "rollout.sampling.temperature": 1.0,
            "optimizer.learning_rate": 2e-4,
            "optimizer.warmup_steps": 5,
            "train.log_every": 1,
            "train.eval_every": 0,
            **values,
        },
    )


def get_config(preset: str = "calculator"):
    if preset not in PRESETS:
        raise ValueError(f"unknown agent preset {preset!r}: {', '.join(PRESETS)}")
    clarify, retrieval = os.path.join(_CLARIFY, "assets"), os.path.join(_RETRIEVAL, "assets")
    if preset == "calculator_sft":  # a solved episode is ~220 tokens
        return _tiny_sft(_ASSETS, "sft.jsonl", "calculator", {"data.max_len": 256})
    if preset in ("calculator", "calculator_faults"):
        return _tiny_grpo(
            os.path.join("runs", "agent", "sft"),
            _ASSETS,
            "train.jsonl",
            "arithmetic",
            {
                "eval_data": [_source(os.path.join(_ASSETS, "eval.jsonl"), "arithmetic")],
                "rollout.max_prompt_len": 160,
                "rollout.max_new_tokens": 128,
                "env.name": "calculator",
                "env.max_turns": 3,
                "env.turn_tokens": 96,
                "env.fault_rate": 0.3 if preset == "calculator_faults" else 0.0,
                "train.steps": 16,
                "train.eval_every": 8,
                "checkpoint.every": 16,
            },
        )
    if preset == "clarify_sft":  # an episode is ~180 tokens, at most 256
        return _tiny_sft(clarify, "sft.jsonl", "clarify", {"data.max_len": 256})
    if preset == "clarify":
        return _tiny_grpo(
            os.path.join(_CLARIFY, "sft"),
            clarify,
            "train.jsonl",
            "clarify",
            {
                "rollout.max_prompt_len": 128,
                "rollout.max_new_tokens": 256,
                "env.name": "clarify",
                "env.max_turns": 4,
                "env.turn_tokens": 96,
                "train.steps": 20,
                "checkpoint.every": 20,
            },
        )
    if preset in ("retrieval_sft", "truncated_sft"):
        search = preset == "retrieval_sft"
        return _tiny_sft(
            retrieval,
            "sft.jsonl" if search else "truncated_sft.jsonl",
            "grounded_qa",
            {
                # A search episode is ~290 tokens (at most ~330); a truncated prompt and its
                # answer fill the window.
                "data.max_len": 384 if search else 512,
                "train.steps": 1800,  # copying the evidence from a search result takes ~1,000
                "checkpoint.every": 600,
            },
        )
    if preset in ("retrieval", "truncated"):
        search = preset == "retrieval"
        if search:  # the question and tools, then a search, its two passages, the answer
            values = {"rollout.max_prompt_len": 144, "rollout.max_new_tokens": 240,
                      "env.name": "retrieval", "env.max_turns": 3,
                      "env.turn_tokens": 96}  # fmt: skip
        else:  # the truncated document and the question, then the answer
            values = {"rollout.max_prompt_len": 416, "rollout.max_new_tokens": 96}
        return _tiny_grpo(
            os.path.join(_RETRIEVAL, "search" if search else preset, "sft"),
            retrieval,
            "train.jsonl" if search else "truncated_train.jsonl",
            "grounded_qa",
            {**values, "train.steps": 40, "checkpoint.every": 40},
        )
    c = load_config_file(os.path.join(_HERE, "grpo.py") + ":qwen3_8b_v5p")
    values = {
        "model.hf_path": "",  # set: a Qwen2.5-7B-Instruct directory (local or gs://)
        "model.preset": "",  # no random 8B when model.hf_path is left unset
        "model.compute_dtype": "bfloat16",  # (an HF directory alone computes in float32)
        "rollout.max_prompt_len": 1024,
        "rollout.max_new_tokens": 4096,
        "env.max_turns": 8,
        "env.turn_tokens": 1024,
    }
    if preset == "python_tool_qwen25_7b":
        values.update({"env.name": "python_tool", "env.options": {"timeout_s": 10.0}})
    else:
        values.update(
            {
                "env.name": "terminal",
                "env.max_turns": 16,
                "data.sources": [_source(_TASKS, "terminal")],
                "eval_data": [],
            }
        )
    return override(c, values)
