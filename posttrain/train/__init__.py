"""Training's generic core: the state, the pure step, the shared loop, checkpoints, the workdir
lock, metrics, the optimizer, params and LoRA setup, and the losses over a model's forward pass
(SFT, the DPO family, reward models). The methods (`posttrain.methods`) build their runs from
them."""

from posttrain.lora import load_checkpoint_model, load_lora_params, load_model_and_tokenizer
from posttrain.models import ModelSpec
from posttrain.rewards import RewardModel, load_reward_model
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer, NonFiniteStateError
from posttrain.train._lock import WorkdirLock, run_lock
from posttrain.train._loop import LoopConfig, TrainingDiverged, train_loop
from posttrain.train._lora import (
    base_inputs,
    base_shardings,
    export_peft,
    lora_json,
    lora_trainable,
    policy_trainable,
)
from posttrain.train._losses import (
    REFERENCES,
    domain_accuracy_sums,
    dpo_loss,
    reference_logps,
    sft_loss,
    stacked_pairs,
)
from posttrain.train._metrics import MetricsWriter, read_metrics
from posttrain.train._optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from posttrain.train._params import start_params, to_json
from posttrain.train._reward import lora_reward_trainable, reward_model_loss, reward_trainable
from posttrain.train._run import (
    StepPlan,
    Trainable,
    check_batching,
    decay_mask,
    each_batch,
    frozen_mask,
    local_rows,
    make_step,
    model_trainable,
    setup,
    summed,
    train,
)
from posttrain.train._state import TrainState, create_state, state_shardings
from posttrain.train._step import BatchPasses, add_moe_aux, split_micro_batches, train_step

__all__ = [
    "BatchPasses",
    "CheckpointConfig",
    "Checkpointer",
    "LoopConfig",
    "MetricsWriter",
    "ModelSpec",
    "NonFiniteStateError",
    "OptimizerConfig",
    "REFERENCES",
    "RewardModel",
    "StepPlan",
    "TrainState",
    "Trainable",
    "TrainingDiverged",
    "WorkdirLock",
    "add_moe_aux",
    "base_inputs",
    "base_shardings",
    "check_batching",
    "create_state",
    "decay_mask",
    "domain_accuracy_sums",
    "dpo_loss",
    "each_batch",
    "frozen_mask",
    "export_peft",
    "learning_rate_schedule",
    "load_checkpoint_model",
    "load_lora_params",
    "load_model_and_tokenizer",
    "load_reward_model",
    "local_rows",
    "lora_json",
    "lora_reward_trainable",
    "lora_trainable",
    "make_optimizer",
    "make_step",
    "model_trainable",
    "policy_trainable",
    "read_metrics",
    "reference_logps",
    "reward_model_loss",
    "reward_trainable",
    "run_lock",
    "setup",
    "sft_loss",
    "split_micro_batches",
    "stacked_pairs",
    "start_params",
    "state_shardings",
    "summed",
    "to_json",
    "train",
    "train_loop",
    "train_step",
]
