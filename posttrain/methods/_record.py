"""The methods' registry: every `Method` record (each defined in its method's module), which
`posttrain train`, `posttrain compile`, `posttrain sweep`, the demo and the notebooks read (eval
reads checkpoints, whatever made them).

A `Method` (`_method.py`) names its config class, its run (the driver: data or rollout source,
evaluation, checkpoints, on the shared loop), and its step as a `StepPlan` (what it trains, its
loss with every option of the config, how each batch is used), which the run jits and
`posttrain compile` lowers: the same function, so the two cannot drift. For the compile it also
gives the step's frozen inputs and batch as abstract arrays, and what the method keeps in
memory beside the step.
"""

from __future__ import annotations

from typing import Any

from posttrain.config import ConfigError, build, to_plain
from posttrain.methods._distill import DISTILL
from posttrain.methods._dpo import DPO
from posttrain.methods._grpo import GRPO
from posttrain.methods._iterative_dpo import ITERATIVE_DPO
from posttrain.methods._method import Method
from posttrain.methods._ppo import PPO
from posttrain.methods._rm import RM
from posttrain.methods._sft import SFT
from posttrain.train import run_lock

METHODS: dict[str, Method] = {m.name: m for m in (SFT, DPO, ITERATIVE_DPO, RM, GRPO, PPO, DISTILL)}


def config_domains(c) -> tuple[str, ...]:
    """The domains a config's training sources name, in order (a run adds those its records
    name; only metric names and a reward model's head count depend on them)."""
    return tuple(dict.fromkeys(s.domain for s in c.data.sources))


def get(name: str) -> Method:
    """The method a config's `method` names."""
    if name not in METHODS:
        raise ConfigError(f"method {name!r} is not available; available: {', '.join(METHODS)}")
    return METHODS[name]


def method_config(config) -> tuple[Method, Any]:
    """(the method, its built config) of a loaded ConfigDict (`method` defaults to "sft"); a
    config the method does not run (a GRPO config under `ppo`) is refused here."""
    values = dict(to_plain(config))
    method = get(values.pop("method", "sft"))
    built = build(method.config, values)
    method.check(built)
    return method, built


def run_from_config(config, workdir: str, **kwargs) -> dict:
    """Runs the method the config names in `workdir` (`kwargs`: the run's, e.g. on_metrics)."""
    method, built = method_config(config)
    with run_lock(workdir):  # released however the run ends, even before its loop starts
        return method.run(built, workdir, **kwargs)
