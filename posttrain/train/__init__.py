"""Training: the state, the pure step, the shared loop, checkpoints, metrics, and the drivers of
SFT, the DPO family and reward models (`posttrain.methods` holds every method's record)."""

from posttrain.lora import load_checkpoint_model, load_lora_params, load_model_and_tokenizer
from posttrain.models import ModelSpec
from posttrain.rewards import RewardModel, load_reward_model
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer, NonFiniteStateError
from posttrain.train._dpo import (
    DPOConfig,
    PreferenceLossConfig,
    dpo_loss,
    dpo_plan,
    reference_logps,
    run_dpo,
)
from posttrain.train._lock import WorkdirLock, run_lock
from posttrain.train._loop import LoopConfig, TrainingDiverged, train_loop
from posttrain.train._lora import (
    base_inputs,
    base_shardings,
    export_peft,
    lora_json,
    policy_trainable,
)
from posttrain.train._metrics import MetricsWriter, read_metrics
from posttrain.train._optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from posttrain.train._params import start_params, to_json
from posttrain.train._rm import (
    RewardModelConfig,
    reward_model_loss,
    reward_trainable,
    rm_plan,
    run_reward_model,
)
from posttrain.train._run import (
    StepPlan,
    Trainable,
    check_batching,
    make_step,
    model_trainable,
    setup,
    train,
)
from posttrain.train._sft import SFTConfig, run_sft, sft_loss, sft_plan
from posttrain.train._state import TrainState, create_state, state_shardings
from posttrain.train._step import BatchPasses, add_moe_aux, split_micro_batches, train_step

__all__ = [
    "CheckpointConfig",
    "DPOConfig",
    "Checkpointer",
    "NonFiniteStateError",
    "LoopConfig",
    "MetricsWriter",
    "ModelSpec",
    "OptimizerConfig",
    "PreferenceLossConfig",
    "RewardModel",
    "RewardModelConfig",
    "SFTConfig",
    "TrainState",
    "TrainingDiverged",
    "WorkdirLock",
    "create_state",
    "dpo_loss",
    "export_peft",
    "learning_rate_schedule",
    "load_checkpoint_model",
    "load_lora_params",
    "load_model_and_tokenizer",
    "load_reward_model",
    "make_optimizer",
    "read_metrics",
    "reference_logps",
    "reward_model_loss",
    "run_dpo",
    "run_reward_model",
    "run_sft",
    "sft_loss",
    "split_micro_batches",
    "state_shardings",
    "train_loop",
    "train_step",
    "BatchPasses",
    "StepPlan",
    "Trainable",
    "add_moe_aux",
    "base_inputs",
    "base_shardings",
    "check_batching",
    "dpo_plan",
    "lora_json",
    "make_step",
    "model_trainable",
    "policy_trainable",
    "reward_trainable",
    "rm_plan",
    "run_lock",
    "setup",
    "sft_plan",
    "start_params",
    "to_json",
    "train",
]
