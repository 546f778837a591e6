"""What a method's record is (`Method`), and the pieces of a record several methods share: the
frozen LoRA base, the policy's frozen inputs, and abstract sharded batch arrays."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from posttrain.lora import quantized_shapes
from posttrain.models import param_shapes, with_shardings
from posttrain.parallel import named_sharding
from posttrain.train import StepPlan, base_shardings


@dataclasses.dataclass(frozen=True)
class Method:
    """A training method.

    Attributes:
      name: what a config's `method` says ("sft", "dpo", "iterative_dpo", "rm", "grpo", "ppo",
        "distill").
      config: its config class (built from the config file's values).
      run: `(config, workdir, *, on_metrics=None) -> summary`, the driver.
      plan: `(config, model_config, mesh, domains) -> StepPlan`, the step the run jits;
        `domains` name its per-domain metrics and a reward model's heads (a run's are its
        data's: the sources' domains, then those records name).
      frozen: `(config, model_config, mesh) -> {name: abstract sharded arrays}`, the step's
        named frozen inputs ("base": a LoRA run's frozen base; "reference": DPO's on-the-fly
        reference).
      batch: `(config, mesh) -> (abstract global batch, tokens, sequence length)` of one step.
      rows: `config -> rows of one optimizer update` (what the mesh must divide).
      devices: `(config, devices) -> the devices the step runs on` (RL's decoupled sampler
        keeps its own).
      resident: `(config, model_config, mesh) -> {name: bytes per device}` the run keeps
        beside the step (a frozen reference, the rollout KV cache).
      lm_head: whether the step computes vocabulary logits (a reward model's trunk does not),
        for the model's FLOPs.
      also_trained: `(config, model_config) -> ((model config, lm_head), ...)`, other models
        the step trains on its tokens (PPO's critic), for the model's FLOPs.
      epochs: `config -> passes the step makes over its batch`, for the model's FLOPs.
      programs: `(config, model_config, mesh) -> {name: posttrain.aot.Program}` the run runs
        beside the step (RL: the co-located sampler's decode call), compiled with it.
      check: `config -> None`, raises `ConfigError` for a config this method does not run
        (a GRPO config given to `ppo`); `method_config` and `run` call it.
    """

    name: str
    config: type
    run: Callable[..., dict]
    plan: Callable[[Any, Any, Any, tuple], StepPlan]
    frozen: Callable[[Any, Any, Any], dict]
    batch: Callable[[Any, Any], tuple[dict, int, int]]
    rows: Callable[[Any], int]
    devices: Callable[[Any, list], list] = lambda c, devices: list(devices)
    resident: Callable[[Any, Any, Any], dict] = lambda c, model_config, mesh: {}
    lm_head: bool = True
    also_trained: Callable[[Any, Any], tuple] = lambda c, model_config: ()
    epochs: Callable[[Any], int] = lambda c: 1
    check: Callable[[Any], None] = lambda c: None
    programs: Callable[[Any, Any, Any], dict] = lambda c, model_config, mesh: {}


def lora_base(c, model_config, mesh):
    """The frozen base a LoRA run's loss takes (quantised for QLoRA), abstract."""
    lora = c.lora
    shapes = param_shapes(model_config)
    if lora.quantize:
        shapes = quantized_shapes(model_config, lora.quantize, lora.quant_block)
    return with_shardings(shapes, base_shardings(lora, model_config, mesh))


def policy_frozen(c, model_config, mesh) -> dict:
    """SFT and RL: the LoRA base, or nothing."""
    return {"base": lora_base(c, model_config, mesh)} if c.lora is not None else {}


def abstract(shapes: dict, mesh) -> dict:
    """`{name: (shape, dtype)}` as arrays sharded over the batch (and length) axes."""
    return {
        k: jax.ShapeDtypeStruct(
            shape,
            dtype,
            sharding=named_sharding(("act_batch", "act_length")[: len(shape)], shape, mesh),
        )
        for k, (shape, dtype) in shapes.items()
    }


SEQUENCE = ("tokens", "targets", "positions", "segment_ids")


def images(c, rows: int, length: int, slots: int = 0) -> dict:
    """A VLM's image slots `[rows, slots, S, S, C]` (slots: default as many as `length` holds);
    nothing for a text model."""
    vision = c.model.model_config().vision
    if vision is None:
        return {}
    slots = slots or max(1, length // vision.tokens_per_image)
    side = vision.image_size
    return {"images": ((rows, slots, side, side, vision.channels), jnp.float32)}
