"""Dispatch from a loaded config to the driver of its method (SFT now; DPO, RM, RL later)."""

from __future__ import annotations

from posttrain.config import build, to_plain
from posttrain.train._sft import SFTConfig, run_sft


def run_from_config(config, workdir: str, **kwargs) -> dict:
    """Runs the method the config names (`method`, default "sft") in `workdir`."""
    values = dict(to_plain(config))
    method = values.pop("method", "sft")
    if method != "sft":
        raise ValueError(f"method {method!r} is not available yet; available: sft")
    return run_sft(build(SFTConfig, values), workdir, **kwargs)
