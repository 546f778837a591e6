"""The agent demos' two stages: SFT warm start, then GRPO from it, each measured after."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

_AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "agent.py")


def sft_then_grpo(
    workdir: str,
    presets: tuple[str, str],
    values: tuple[dict, dict],
    measure: Callable,
    what: tuple[str, str],
    console,
) -> dict:
    """Runs configs/agent.py:`presets[0]` (SFT, into `workdir/sft`) with `values[0]` set, then
    `presets[1]` (GRPO from it, into `workdir/grpo`) with `values[1]`; `measure(model)` after
    each. Both start from scratch (an old run there is removed: a workdir would resume).

    Returns:
      {"sft": measure after SFT, "rl": after GRPO, "sft_seconds", "rl_seconds"}.
    """
    import jax

    from posttrain.config import load_config_file, override
    from posttrain.methods import method_config
    from posttrain.models import Transformer

    out: dict = {}
    previous = None
    for stage, (preset, overrides, doing, name) in enumerate(
        zip(presets, values, what, ("sft", "grpo"), strict=True)
    ):
        run_dir = os.path.join(workdir, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        if previous is not None:
            overrides = {"model.checkpoint": previous, **overrides}
        method, config = method_config(override(load_config_file(f"{_AGENT}:{preset}"), overrides))
        console.print(f"stage {stage + 1} · {doing.format(config=config)}")
        start = time.perf_counter()
        summary = method.run(config, run_dir)
        out[f"{'sft' if name == 'sft' else 'rl'}_seconds"] = time.perf_counter() - start
        model = Transformer(jax.device_get(summary["state"].params), summary["model_config"])
        out["sft" if name == "sft" else "rl"] = measure(jax.device_put(model))
        previous = run_dir
    return out
