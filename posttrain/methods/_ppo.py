"""PPO: the RL run (`_grpo.py`) with a critic: per-token GAE advantages
(`algorithm.advantage=gae`) from a value model trained beside the policy (`critic.*`,
configs/ppo.py). The record refuses a config without the critic."""

from posttrain.config import ConfigError
from posttrain.methods._grpo import rl_method
from posttrain.rl import RLConfig


def _check(c: RLConfig) -> None:
    if not c.ppo:
        raise ConfigError(
            f"method=ppo trains a critic: set algorithm.advantage=gae (configs/ppo.py), not "
            f"{c.algorithm.advantage!r}, or method=grpo for group advantages"
        )


PPO = rl_method("ppo", _check)
