"""Training methods (sft, dpo, iterative_dpo, rm, grpo, ppo, distill): one module each with its
config, plan, frozen inputs, batch spec, driver and `Method` record, which `posttrain train`,
`posttrain compile`, `posttrain sweep`, the demo and the notebooks reach through `get(name)` or
`run_from_config` (see `_record.py`). The offline stages before RL (rejection-sampling
fine-tuning, offline RL on logged trajectories) are composed in the RL driver."""

from posttrain.methods._compile import compile_plan, lowering, remat_sweep, smallest_fit
from posttrain.methods._dpo import DPOConfig, PreferenceLossConfig, dpo_plan, run_dpo
from posttrain.methods._grpo import rl_plan, run_rl, split_devices
from posttrain.methods._iterative_dpo import IterativeDPOConfig, run_iterative_dpo
from posttrain.methods._method import Method
from posttrain.methods._offline_rl import LoggedTrajectories, logged_advantages, offline_rl
from posttrain.methods._record import (
    METHODS,
    config_domains,
    get,
    method_config,
    run_from_config,
)
from posttrain.methods._rm import RewardModelConfig, rm_plan, run_reward_model
from posttrain.methods._sft import SFTConfig, run_sft, sft_batch, sft_plan
from posttrain.methods._sweep import expand, grid_values, load_sweep, run_sweep, sample_space

__all__ = [
    "DPOConfig",
    "IterativeDPOConfig",
    "LoggedTrajectories",
    "METHODS",
    "Method",
    "PreferenceLossConfig",
    "RewardModelConfig",
    "SFTConfig",
    "compile_plan",
    "config_domains",
    "dpo_plan",
    "get",
    "logged_advantages",
    "lowering",
    "method_config",
    "offline_rl",
    "remat_sweep",
    "rl_plan",
    "rm_plan",
    "run_dpo",
    "run_from_config",
    "run_iterative_dpo",
    "run_reward_model",
    "run_rl",
    "run_sft",
    "run_sweep",
    "expand",
    "grid_values",
    "load_sweep",
    "sample_space",
    "sft_batch",
    "sft_plan",
    "smallest_fit",
    "split_devices",
]
