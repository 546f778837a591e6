"""LoRA runs: the adapters are the train state; the frozen base is a traced input of the loss.

A LoRA checkpoint holds only the adapters (and their optimizer state); its JSON item `lora`
points at the base (`ModelSpec` and the init seed), which `load_lora_params` rebuilds.
"""

from __future__ import annotations

import functools
import logging

import jax

from posttrain.config import ConfigError, build
from posttrain.lora import (
    LoRAConfig,
    adapter_shapes,
    adapter_shardings,
    init_adapters,
    merge,
    param_bytes,
    quantize_params,
    quantized_shardings,
    save_peft,
)
from posttrain.models import ModelConfig, from_hf, init_params, param_shapes, param_shardings
from posttrain.train._run import (
    ModelSpec,
    Trainable,
    checkpoint_json,
    restore_params,
    start_params,
    to_json,
    with_shardings,
)

log = logging.getLogger(__name__)

# `merge` compiled once per (shapes, LoRAConfig): loading checkpoint after checkpoint (eval)
# and evaluating during a run reuse it.
merge_jit = jax.jit(merge, static_argnames="lora")


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


def quantize_base(lora: LoRAConfig, params: dict, model_config: ModelConfig, mesh=None):
    """QLoRA: the base with its layer matrices quantised (`lora.quantize`), sharded like the
    weights they replace on `mesh`; unchanged without `lora.quantize`."""
    if not lora.quantize:
        return params
    quantize = functools.partial(
        quantize_params, model_config=model_config, format=lora.quantize, block=lora.quant_block
    )
    shardings = None
    if mesh is not None:
        shardings = quantized_shardings(model_config, lora.quantize, lora.quant_block, mesh)
    return jax.jit(quantize, out_shardings=shardings)(params)


def base_shardings(lora: LoRAConfig, model_config: ModelConfig, mesh):
    """The frozen base's shardings (quantised or not)."""
    if lora.quantize:
        return quantized_shardings(model_config, lora.quantize, lora.quant_block, mesh)
    return param_shardings(model_config, mesh)


def base_inputs(lora: LoRAConfig, spec: ModelSpec, model_config: ModelConfig, mesh, seed: int):
    """`((base params,), (their shardings,))`: the frozen base (quantised for QLoRA) as the
    loss's traced input."""
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
    return (params,), (base_shardings(lora, model_config, mesh),)


def lora_json(lora: LoRAConfig, spec: ModelSpec, seed: int, under: tuple[str, ...] = ()) -> dict:
    """The checkpoint item that makes a LoRA checkpoint loadable: adapters config, the base,
    and where the adapters sit in the saved params (`under`: () for the params themselves,
    ("policy",) for PPO's `{"policy", "value"}`)."""
    return {"config": to_json(lora), "base": to_json(spec), "seed": seed, "under": list(under)}


def on_default_device(shapes):
    """`shapes` with the default device's sharding (for `restore_params`)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return with_shardings(shapes, jax.tree.map(lambda _: device, shapes))


def saved_base(saved: dict):
    """(frozen base params, LoRAConfig) of a LoRA checkpoint's JSON items, on the default
    device; a QLoRA base comes back quantised, as the run trained on it."""
    item = saved["lora"]
    lora = LoRAConfig.from_config(item["config"])
    model_config = build(ModelConfig, saved["model_config"])
    spec = build(ModelSpec, item["base"])
    if spec.hf_path:
        base = from_hf(spec.hf_path, **spec.overrides()).params
    elif spec.checkpoint:
        base = start_params_single(spec, model_config)
    else:
        base = init_params(model_config, jax.random.key(item["seed"]))
    return quantize_base(lora, base, model_config), lora


def load_lora_params(workdir: str, step: int | None = None, *, merged: bool = True):
    """A LoRA run's (base params, adapters, LoRAConfig), or the merged params when `merged`,
    on the default device. A QLoRA base is quantised (merged: dequantised, then merged), so
    the merged model is the one the run trained."""
    saved = checkpoint_json(workdir, step)
    base, lora = saved_base(saved)
    model_config = build(ModelConfig, saved["model_config"])
    shapes = on_default_device(adapter_shapes(model_config, lora))
    under = saved["lora"].get("under", [])
    for key in reversed(under):
        shapes = {key: shapes}
    adapters = restore_params(workdir, shapes, saved["step"])
    for key in under:
        adapters = adapters[key]
    if merged:
        return merge_jit(base, adapters, lora=lora)
    return base, adapters, lora


def start_params_single(spec: ModelSpec, model_config: ModelConfig):
    """A base restored from another run's checkpoint (itself possibly a LoRA run)."""
    if "lora" in checkpoint_json(spec.checkpoint):
        return load_lora_params(spec.checkpoint)
    return restore_params(spec.checkpoint, on_default_device(param_shapes(model_config)))


def export_peft(workdir: str, out: str, step: int | None = None) -> None:
    """Writes a LoRA run's adapters unmerged, in HF PEFT's layout (`posttrain.lora.save_peft`)."""
    saved = checkpoint_json(workdir, step)
    if "lora" not in saved:
        raise ConfigError(
            f"{workdir} is not a LoRA run (its checkpoint holds full weights); export it "
            "without --nomerge-lora"
        )
    _, adapters, lora = load_lora_params(workdir, saved["step"], merged=False)
    model_config = build(ModelConfig, saved["model_config"])
    base = saved["lora"]["base"]
    save_peft(model_config, adapters, lora, out, base_model=base["hf_path"] or base["checkpoint"])
