"""On-policy distillation: the RL run (`_grpo.py`) whose per-token advantage is the teacher's
log-prob minus the student's on the student's own samples (plus `distill.reward_coef` times
the task reward's advantage; docs/rl.md). The record refuses a config without a teacher; a
`grpo` (or `ppo`) config with `distill.teacher` set distils too."""

from posttrain.config import ConfigError
from posttrain.methods._grpo import rl_method
from posttrain.rl import RLConfig


def _check(c: RLConfig) -> None:
    if not c.distill.enabled:
        raise ConfigError(
            "method=distill needs a teacher: set distill.teacher to a run's workdir or an HF "
            "model directory (same vocabulary as the policy)"
        )


DISTILL = rl_method("distill", _check)
