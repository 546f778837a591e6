"""A finished run's model read back from its workdir: a LoRA run's frozen base rebuilt from the
`ModelSpec` its checkpoint names and its adapters merged in (`load_lora_params`), any run's
`Transformer` (`load_checkpoint_model`), and an HF directory or a workdir with its tokenizer
(`load_model_and_tokenizer`).

A LoRA checkpoint holds only the adapters (and their optimizer state); its JSON item `lora`
points at the base (`ModelSpec` and the init seed), which `saved_base` rebuilds.
"""

from __future__ import annotations

import functools
import json

import jax

from posttrain import paths
from posttrain.config import build
from posttrain.data import load_tokenizer
from posttrain.lora._adapters import adapter_shapes, merge
from posttrain.lora._config import LoRAConfig
from posttrain.lora._quant import quantize_params, quantized_shardings
from posttrain.models import (
    ModelConfig,
    ModelSpec,
    Transformer,
    checkpoint_json,
    from_hf,
    init_params,
    model_params,
    on_default_device,
    param_shapes,
    param_shardings,
    restore_params,
    with_shardings,
)
from posttrain.parallel import mesh_of

# `merge` compiled once per (shapes, LoRAConfig): loading checkpoint after checkpoint (eval)
# and evaluating during a run reuse it.
merge_jit = jax.jit(merge, static_argnames="lora")


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
    if merged:  # (where they are, whatever mesh the caller has set: a run's may span processes)
        with jax.set_mesh(mesh_of(base)):
            return merge_jit(base, adapters, lora=lora)
    return base, adapters, lora


def start_params_single(spec: ModelSpec, model_config: ModelConfig):
    """A base restored from another run's checkpoint (itself possibly a LoRA run)."""
    if "lora" in checkpoint_json(spec.checkpoint):
        return load_lora_params(spec.checkpoint)
    return model_params(spec.checkpoint, on_default_device(param_shapes(model_config)))


def load_checkpoint_model(workdir: str, step: int | None = None, *, mesh=None) -> Transformer:
    """The model (params + config) of a run's checkpoint (SFT, DPO, GRPO, PPO's policy); a
    LoRA run's adapters come back merged into its base. With `mesh` the params are read
    straight onto the model's shardings over it (each device reads only its shards), else onto
    the default device."""
    saved = checkpoint_json(workdir, step)
    model_config = build(ModelConfig, saved["model_config"])
    shardings = param_shardings(model_config, mesh) if mesh is not None else None
    if "lora" in saved:
        params = load_lora_params(workdir, saved["step"])
        return Transformer(
            params if mesh is None else jax.device_put(params, shardings), model_config
        )
    if mesh is None:
        abstract = on_default_device(param_shapes(model_config))
    else:
        abstract = with_shardings(param_shapes(model_config), shardings)
    return Transformer(model_params(workdir, abstract, saved["step"]), model_config)


def load_model_and_tokenizer(path: str, *, mesh=None):
    """`(Transformer, Tokenizer)` of an HF model directory (config.json + safetensors +
    tokenizer files) or a training workdir (its latest checkpoint and the tokenizer its config
    names); with `mesh`, the params sharded over it."""
    if (paths.path(path) / "checkpoints").is_dir():
        config = json.loads((paths.path(path) / "config.json").read_text())
        tokenizer_dir = config.get("tokenizer") or config.get("model", {}).get("hf_path")
        return load_checkpoint_model(path, mesh=mesh), load_tokenizer(tokenizer_dir)
    if (paths.path(path) / "config.json").is_file():
        return from_hf(path, mesh=mesh), load_tokenizer(path)
    raise FileNotFoundError(
        f"{path!r} is neither an HF model directory (config.json) nor a "
        f"training workdir (checkpoints/)"
    )
