"""On-policy distillation's teacher: a frozen model that scores the tokens the policy sampled.

The teacher is another run's checkpoint or an HF model directory (`distill.teacher`), of any
size but with the policy's vocabulary. It runs either sharded over the training devices beside
the policy (its params cost memory there; its pass runs between sampling and the updates, as
the reference's does), or on its own devices (`distill.teacher_devices`, carved out of the
training devices before the decoupled sampler's), where a teacher larger than the student does
not crowd the training state.
"""

from __future__ import annotations

import jax
import numpy as np

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.models import ModelConfig, ModelSpec
from posttrain.parallel import last_of_each_process, process_rows, shard_batch
from posttrain.rl._loss import sequence_log_probs
from posttrain.rl._shares import host_array
from posttrain.train import start_params

_SEQUENCE = ("tokens", "targets", "positions", "segment_ids")


def teacher_model(path: str, policy_config: ModelConfig) -> tuple[ModelSpec, ModelConfig]:
    """The teacher's `ModelSpec` and model config: `path` is a run's workdir (its latest
    checkpoint; a PPO or LoRA run's policy) or an HF model directory (config.json +
    safetensors), with the policy's vocabulary.

    Raises:
      ConfigError: a path that holds no model, or a teacher with another vocabulary size.
    """
    if (paths.path(path) / "checkpoints").is_dir():
        spec = ModelSpec(checkpoint=path)
    elif (paths.path(path) / "config.json").is_file():
        spec = ModelSpec(hf_path=path)
    else:
        raise ConfigError(
            f"distill.teacher={path!r} is neither a training workdir (checkpoints/) nor an HF "
            "model directory (config.json); point it at the teacher model"
        )
    config = spec.model_config()
    if config.vocab_size != policy_config.vocab_size:
        raise ConfigError(
            f"distill.teacher={path!r} has vocab_size={config.vocab_size} but the policy has "
            f"{policy_config.vocab_size}: distillation compares the two models' log-probs of the "
            "same token ids, so use a teacher with the policy's tokenizer"
        )
    return spec, config


def split_teacher_devices(n: int, devices: list) -> tuple[list, list | None]:
    """(training devices, teacher devices or None): with `n > 0` the teacher gets the last `n`
    of each process's `devices` (the training devices once the sampler's are taken), so on
    several processes it is sharded across them as the policy is."""
    if not n:
        return devices, None
    try:
        teacher = last_of_each_process(devices, n)
    except ValueError as e:
        raise ConfigError(
            f"distill.teacher_devices: {e} (after the sampler's); lower it or "
            "rollout.sampler_devices"
        ) from None
    return [d for d in devices if d not in teacher], teacher


class Teacher:
    """The teacher's log-probs of a rollout batch's targets.

    Args:
      path: the teacher (`teacher_model`).
      policy_config: the student's model config (the vocabularies must match).
      mesh: where the teacher runs: the training mesh, or its own (`own_mesh`).
      own_mesh: whether `mesh` is the teacher's own (the batch is placed there) rather than the
        training mesh (the Scorer's device batch is reused).
    """

    def __init__(self, path: str, policy_config: ModelConfig, mesh, *, own_mesh: bool):
        spec, self.model_config = teacher_model(path, policy_config)
        self.mesh, self.own_mesh = mesh, own_mesh
        with jax.set_mesh(mesh):
            # (a checkpoint or HF weights: no random init, so the seed is unused)
            self.params = start_params(spec, self.model_config, mesh, seed=0)
        model_config = self.model_config
        self._logps = jax.jit(lambda params, batch: sequence_log_probs(params, model_config, batch))

    def logps(self, batch: dict[str, np.ndarray], device_batch: dict) -> np.ndarray:
        """`[B, L]` float32 log-probs of `batch["targets"]` under the teacher, on the host;
        `device_batch` is the batch on the training mesh (used when the teacher runs there)."""
        if not self.own_mesh:
            return host_array(self._logps(self.params, device_batch))
        with jax.set_mesh(self.mesh):  # (each process feeds its rows, gets every row back)
            rows = process_rows(len(batch["targets"]), self.mesh)
            placed = shard_batch({k: batch[k][rows] for k in _SEQUENCE}, self.mesh)
            return host_array(self._logps(self.params, placed))
