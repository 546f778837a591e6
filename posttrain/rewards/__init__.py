"""Verifiable rewards: reward functions by domain, scored in a pool of killable workers.

A reward function is `fn(record, completion) -> (score, info)`. A `RewardRegistry` maps each
record's "domain" to weighted reward functions (`default_registry()` has math, code, format,
tool_call, extraction, grounded_qa and the demo's arithmetic; "rm:" and "judge:" references add
reward and judge models); `RewardPool` scores batches in worker processes, each completion under
a deadline, so a hung or crashing verifier costs one zero reward, not a step.

    registry = default_registry()
    registry.check({r["domain"] for r in dataset})  # unknown domains fail here, not mid-run
    with RewardPool(registry, workers=8, timeout_s=10) as pool:
        rewards = [r.score for r in pool.score(records, completions)]
"""

from posttrain.rewards import sandbox
from posttrain.rewards._arithmetic import arithmetic_reward, extract_integer, integer_correct
from posttrain.rewards._cad_geometry import measure as measure_solid
from posttrain.rewards._cad_kernel import build as build_solid
from posttrain.rewards._code import code_reward, code_reward_all_pass, extract_code
from posttrain.rewards._code_quality import LINT_GROUPS, code_quality_reward, lint
from posttrain.rewards._difficulty import filter_by_pass_rate, pass_at_k, pass_rate
from posttrain.rewards._extraction import extraction_reward, field_f1
from posttrain.rewards._format import (
    check_format,
    format_reward,
    overlong_penalty,
    tool_call_reward,
)
from posttrain.rewards._grounded import grounded_qa_reward, token_f1
from posttrain.rewards._judge import (
    DEFAULT_RUBRIC,
    JudgeConfig,
    JudgeReward,
    is_judge_ref,
    parse_judge_ref,
)
from posttrain.rewards._math import extract_answer, math_equal, math_reward
from posttrain.rewards._parts import component_means, tally_components
from posttrain.rewards._pool import RewardPool, RewardResult, summarize
from posttrain.rewards._registry import (
    RewardFn,
    RewardRegistry,
    RewardTerm,
    default_registry,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeConfig",
    "JudgeReward",
    "Measurements",
    "RewardFn",
    "RewardModel",
    "RewardPool",
    "RewardRegistry",
    "RewardResult",
    "RewardTerm",
    "arithmetic_reward",
    "build_solid",
    "CAD_AGGREGATES",
    "cad_reward",
    "cad_sft_record",
    "check_format",
    "code_reward",
    "code_quality_reward",
    "lint",
    "LINT_GROUPS",
    "component_means",
    "tally_components",
    "code_reward_all_pass",
    "completion_part",
    "default_registry",
    "extract_answer",
    "extraction_reward",
    "extract_code",
    "extract_integer",
    "field_f1",
    "filter_by_pass_rate",
    "format_reward",
    "grounded_qa_reward",
    "integer_correct",
    "make_cad_task",
    "load_reward_model",
    "math_equal",
    "math_reward",
    "measure_solid",
    "overlong_penalty",
    "pass_at_k",
    "is_judge_ref",
    "parse_judge_ref",
    "pass_rate",
    "render_grid",
    "render_views",
    "reward_params",
    "reward_scores",
    "reward_shapes",
    "run_script",
    "sandbox",
    "summarize",
    "token_f1",
    "tool_call_reward",
    "without_lm_head",
]

# Loaded only when asked for, so the verifiers stay light to import (reward workers): a trained
# reward model runs on jax; the CAD kernel, renderer and geometry bring their own dependencies.
_LAZY = {
    **dict.fromkeys(("RewardModel", "load_reward_model", "reward_params", "reward_scores",
                     "reward_shapes", "without_lm_head"), "_reward_model"),
    **dict.fromkeys(("cad_reward", "completion_part", "run_script"), "_cad"),
    **dict.fromkeys(("cad_sft_record", "make_cad_task"), "_cad_tasks"),
    **dict.fromkeys(("Measurements", "CAD_AGGREGATES"), "_cad_geometry"),
    **dict.fromkeys(("render_grid", "render_views"), "_cad_render"),
}  # fmt: skip


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"posttrain.rewards.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
