"""LoRA runs: the adapters are the train state; the frozen base is a traced input of the loss.

A LoRA checkpoint holds only the adapters (and their optimizer state); its JSON item `lora`
(`lora_json`) points at the base (`ModelSpec` and the init seed), which
`posttrain.lora.load_lora_params` rebuilds.
"""

from __future__ import annotations

import logging

import jax

from posttrain.config import ConfigError, build
from posttrain.lora import (
    LoRAConfig,
    adapter_shapes,
    adapter_shardings,
    init_adapters,
    load_lora_params,
    param_bytes,
    quantize_base,
    quantized_shardings,
    save_peft,
)
from posttrain.models import (
    ModelConfig,
    ModelSpec,
    checkpoint_json,
    param_shardings,
    staged_export,
)
from posttrain.train._params import start_params, to_json
from posttrain.train._run import Trainable, model_trainable

log = logging.getLogger(__name__)


def lora_trainable(lora: LoRAConfig, model_config: ModelConfig, mesh, seed: int) -> Trainable:
    """Only the adapters: they alone get gradients and optimizer state (weight decay on both
    factors)."""
    shapes = adapter_shapes(model_config, lora)
    return Trainable(
        shapes=shapes,
        shardings=adapter_shardings(model_config, lora, mesh),
        decay_mask=jax.tree.map(lambda _: True, shapes),
        # (seed + 1: the adapters' draws differ from a random-init base's)
        init=lambda: init_adapters(model_config, lora, jax.random.key(seed + 1), mesh),
    )


def policy_trainable(config, model_config: ModelConfig, mesh) -> Trainable:
    """What a method's policy trains: the model (`config.model`), or with `config.lora` only
    the adapters on it."""
    seed = config.train.seed
    if config.lora is None:
        return model_trainable(config.model, model_config, mesh, seed)
    return lora_trainable(config.lora, model_config, mesh, seed)


def base_shardings(lora: LoRAConfig, model_config: ModelConfig, mesh):
    """The frozen base's shardings (quantised or not)."""
    if lora.quantize:
        return quantized_shardings(model_config, lora.quantize, lora.quant_block, mesh)
    return param_shardings(model_config, mesh)


def base_inputs(lora: LoRAConfig, spec: ModelSpec, model_config: ModelConfig, mesh, seed: int):
    """`({"base": params}, {"base": shardings})`: the frozen base (quantised for QLoRA) as the
    loss's named traced input."""
    params = start_params(spec, model_config, mesh, seed)
    if lora.quantize:
        full = param_bytes(params)
        params = quantize_base(lora, params, model_config, mesh)
        log.info(
            "QLoRA: the frozen base takes %.3f GiB stored as %s (%.3f GiB in %s)",
            param_bytes(params) / 2**30,
            lora.quantize,
            full / 2**30,
            model_config.param_dtype,
        )
    return {"base": params}, {"base": base_shardings(lora, model_config, mesh)}


def lora_json(lora: LoRAConfig, spec: ModelSpec, seed: int, under: tuple[str, ...] = ()) -> dict:
    """The checkpoint item that makes a LoRA checkpoint loadable: adapters config, the base,
    and where the adapters sit in the saved params (`under`: () for the params themselves,
    ("policy",) for PPO's `{"policy", "value"}`)."""
    return {"config": to_json(lora), "base": to_json(spec), "seed": seed, "under": list(under)}


def export_peft(
    workdir: str, out: str, step: int | None = None, *, overwrite: bool = False
) -> None:
    """Writes a LoRA run's adapters unmerged, in HF PEFT's layout (`posttrain.lora.save_peft`),
    replacing a previous export at `out` whole (as `posttrain.models.to_hf` does); `overwrite`
    exports into a non-empty folder that holds no export."""
    with staged_export(out, overwrite=overwrite) as staging:  # refuses a bad `out` first
        saved = checkpoint_json(workdir, step)
        if "lora" not in saved:
            raise ConfigError(
                f"{workdir} is not a LoRA run (its checkpoint holds full weights); export it "
                "without --nomerge-lora"
            )
        _, adapters, lora = load_lora_params(workdir, saved["step"], merged=False)
        model_config = build(ModelConfig, saved["model_config"])
        base = saved["lora"]["base"]
        save_peft(
            model_config,
            adapters,
            lora,
            staging,
            base_model=base["hf_path"] or base["checkpoint"],
        )
