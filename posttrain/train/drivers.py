"""Dispatch from a loaded config to the driver of its method (`method`: sft, dpo, rm, grpo,
ppo)."""

from __future__ import annotations

from posttrain.config import build, to_plain
from posttrain.eval import suite_evaluator
from posttrain.train._dpo import DPOConfig, run_dpo
from posttrain.train._rm import RewardModelConfig, run_reward_model
from posttrain.train._sft import SFTConfig, run_sft


def _sft(config: SFTConfig, workdir: str, **kwargs) -> dict:
    """SFT with its periodic eval suite, built here: eval imports train, not the reverse."""
    suite = suite_evaluator(config.eval_suite) if config.eval_suite else None
    return run_sft(config, workdir, suite=suite, **kwargs)


DRIVERS = {
    "sft": (SFTConfig, _sft),
    "dpo": (DPOConfig, run_dpo),
    "rm": (RewardModelConfig, run_reward_model),
}


def _driver(method: str):
    if method in ("grpo", "ppo"):  # imported here: posttrain.rl imports posttrain.train
        from posttrain.rl import RLConfig, run_rl

        return RLConfig, run_rl
    if method not in DRIVERS:
        raise ValueError(
            f"method {method!r} is not available; available: {', '.join([*DRIVERS, 'grpo', 'ppo'])}"
        )
    return DRIVERS[method]


def run_from_config(config, workdir: str, **kwargs) -> dict:
    """Runs the method the config names (`method`, default "sft") in `workdir`."""
    values = dict(to_plain(config))
    method = values.pop("method", "sft")
    cls, run = _driver(method)
    return run(build(cls, values), workdir, **kwargs)
