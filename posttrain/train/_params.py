"""Where a run's params come from: a preset's random init, an HF directory's weights, or a
run's checkpoint (a `posttrain.models.ModelSpec`; a LoRA run's adapters merged into the base it
names); and the checks a run makes before it writes into a workdir.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

from posttrain import paths
from posttrain.config import ConfigError, build
from posttrain.lora import load_lora_params
from posttrain.models import (
    ModelConfig,
    ModelSpec,
    checkpoint_json,
    from_hf,
    init_params,
    model_params,
    param_shapes,
    param_shardings,
    with_shardings,
)


def to_json(value) -> Any:
    """A (nested) dataclass as plain JSON values."""
    return json.loads(json.dumps(dataclasses.asdict(value), default=str))


def check_same_model(workdir: str, model_config: ModelConfig) -> None:
    """Refuses (`ConfigError`) a workdir whose newest readable checkpoint holds another model
    (other parameter shapes or dtype), before the run rewrites anything in it."""
    directory = paths.path(workdir) / "checkpoints"
    if not directory.is_dir():
        return
    steps = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True)
    for step in steps:
        try:
            saved = build(
                ModelConfig,
                json.loads((directory / str(step) / "model_config" / "metadata").read_text()),
            )
        except (OSError, ValueError):
            continue  # unreadable: the restore moves it aside and tries the previous one
        shapes = lambda c: jax.tree.map(lambda s: (s.shape, str(s.dtype)), param_shapes(c))
        if shapes(saved) == shapes(model_config):
            return
        old, new = to_json(saved), to_json(model_config)
        # Settings that may change between runs of one model.
        runtime = ("attention", "remat", "logits_chunk", "context_parallel",
                   "pipeline_microbatches", "pipeline_remat", "pipeline_schedule", "compute_dtype",
                   "batch_invariant", "name")  # fmt: skip
        changed = [k for k in new if k not in runtime and old.get(k) != new[k]]
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in changed)
        raise ConfigError(
            f"{workdir} holds checkpoints of another model ({details or 'other parameters'}; "
            f"newest: step {step}); train this model in a new --workdir, or restore the model "
            "settings of that run to resume it"
        )


def start_params(spec: ModelSpec, model_config: ModelConfig, mesh, seed: int):
    """The transformer params a run starts from, sharded on `mesh`."""
    if spec.hf_path:
        return from_hf(spec.hf_path, mesh=mesh, **spec.overrides()).params
    if spec.checkpoint:
        shardings = param_shardings(model_config, mesh)
        if "lora" in checkpoint_json(spec.checkpoint):  # a LoRA run: its merged weights
            # (through the host: on several processes each places its shards of its copy)
            merged = jax.device_get(load_lora_params(spec.checkpoint))
            return jax.device_put(merged, shardings)
        return model_params(spec.checkpoint, with_shardings(param_shapes(model_config), shardings))
    return init_params(model_config, jax.random.key(seed), mesh)
