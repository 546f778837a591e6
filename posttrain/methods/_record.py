"""One record per method: everything `posttrain train`, `posttrain compile`, `posttrain sweep`
and the notebooks need to know about it, in one place (eval reads checkpoints, whatever made
them).

A `Method` names its config class, its run (the driver: data or rollout source, evaluation,
checkpoints, on the shared loop), and its step as a `StepPlan` (what it trains, its loss with
every option of the config, how each batch is used), which the run jits and `posttrain compile`
lowers: the same function, so the two cannot drift. For the compile it also gives the step's
frozen inputs and batch as abstract arrays, and what the method keeps in memory beside the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from posttrain.aot import bytes_per_device
from posttrain.config import ConfigError, build, to_plain
from posttrain.data import prompt_slots
from posttrain.eval import suite_evaluator
from posttrain.lora import quantized_shapes
from posttrain.methods._iterative_dpo import IterativeDPOConfig, run_iterative_dpo
from posttrain.models import param_shapes, param_shardings, with_shardings
from posttrain.parallel import named_sharding
from posttrain.rewards import without_lm_head as _trunk
from posttrain.rl import (
    RLConfig,
    rl_plan,
    route_shape,
    run_rl,
    split_devices,
)
from posttrain.train import (
    DPOConfig,
    RewardModelConfig,
    SFTConfig,
    StepPlan,
    base_shardings,
    dpo_plan,
    rm_plan,
    run_dpo,
    run_lock,
    run_reward_model,
    run_sft,
    sft_plan,
)


@dataclasses.dataclass(frozen=True)
class Method:
    """A training method.

    Attributes:
      name: what a config's `method` says ("sft", "dpo", "iterative_dpo", "rm", "grpo", "ppo").
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


def config_domains(c) -> tuple[str, ...]:
    """The domains a config's training sources name, in order (a run adds those its records
    name; only metric names and a reward model's head count depend on them)."""
    return tuple(dict.fromkeys(s.domain for s in c.data.sources))


def _lora_base(c, model_config, mesh):
    """The frozen base a LoRA run's loss takes (quantised for QLoRA), abstract."""
    lora = c.lora
    shapes = param_shapes(model_config)
    if lora.quantize:
        shapes = quantized_shapes(model_config, lora.quantize, lora.quant_block)
    return with_shardings(shapes, base_shardings(lora, model_config, mesh))


def _policy_frozen(c, model_config, mesh) -> dict:
    """SFT and RL: the LoRA base, or nothing."""
    return {"base": _lora_base(c, model_config, mesh)} if c.lora is not None else {}


def _dpo_frozen(c, model_config, mesh) -> dict:
    """The LoRA base (whose adapters-off pass is the reference), else the on-the-fly reference
    (a second copy of the policy's weights), else nothing."""
    if c.lora is not None:
        return {"base": _lora_base(c, model_config, mesh)}
    if c.loss.resolved_reference == "on_the_fly":
        full = with_shardings(param_shapes(model_config), param_shardings(model_config, mesh))
        return {"reference": full}
    return {}


def _rm_frozen(c, model_config, mesh) -> dict:
    return {"base": _trunk(_lora_base(c, model_config, mesh))} if c.lora is not None else {}


def _abstract(shapes: dict, mesh) -> dict:
    """`{name: (shape, dtype)}` as arrays sharded over the batch (and length) axes."""
    return {
        k: jax.ShapeDtypeStruct(
            shape,
            dtype,
            sharding=named_sharding(("act_batch", "act_length")[: len(shape)], shape, mesh),
        )
        for k, (shape, dtype) in shapes.items()
    }


_SEQUENCE = ("tokens", "targets", "positions", "segment_ids")


def _images(c, rows: int, length: int, slots: int = 0) -> dict:
    """A VLM's image slots `[rows, slots, S, S, C]` (slots: default as many as `length` holds);
    nothing for a text model."""
    vision = c.model.model_config().vision
    if vision is None:
        return {}
    slots = slots or max(1, length // vision.tokens_per_image)
    side = vision.image_size
    return {"images": ((rows, slots, side, side, vision.channels), jnp.float32)}


def _sft_batch(c, mesh):
    rows, length = c.data.batch_size, c.data.max_len
    shapes = {k: ((rows, length), jnp.int32) for k in (*_SEQUENCE, "domain_ids")}
    shapes["loss_mask"] = ((rows, length), jnp.float32)
    shapes |= _images(c, rows, length, c.data.max_images)
    return _abstract(shapes, mesh), rows * length, length


def _preference_batch(c, mesh, references: bool = False, images: bool = False):
    """Pairs (`references`: with their precomputed reference log-probs; `images`: a VLM's pair
    images, DPO)."""
    rows, length = c.data.batch_size, c.data.max_len
    shapes = {}
    for side in ("chosen", "rejected"):
        shapes |= {f"{side}_{k}": ((rows, length), jnp.int32) for k in _SEQUENCE}
        shapes[f"{side}_loss_mask"] = ((rows, length), jnp.float32)
    shapes |= {"domain_ids": ((rows,), jnp.int32), "margins": ((rows,), jnp.float32)}
    shapes |= _images(c, rows, length, c.data.max_images) if images else {}
    if references:
        shapes |= {k: ((rows,), jnp.float32) for k in ("ref_chosen_logps", "ref_rejected_logps")}
    return _abstract(shapes, mesh), 2 * rows * length, length


def _dpo_batch(c, mesh):
    return _preference_batch(c, mesh, c.loss.resolved_reference == "precomputed", images=True)


def _rl_batch(c, mesh):
    """One RL step's rollout batch: every row of the step (its minibatches and epochs are
    updates inside the step)."""
    rows = c.rows
    length = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    floats = ("loss_mask", "sampler_logps", "old_logps")
    floats += ("ref_logps",) * c.kl.enabled + ("returns", "old_values") * c.ppo
    per_row = {"rewards": jnp.float32, "truncated": jnp.float32, "kl_coefs": jnp.float32,
               "lengths": jnp.float32, "domain_ids": jnp.int32}  # fmt: skip
    shapes = {k: ((rows, length), jnp.int32) for k in _SEQUENCE}
    shapes |= {k: ((rows, length), jnp.float32) for k in floats}
    shapes |= {k: ((rows,), t) for k, t in per_row.items()}
    per_token = c.ppo or c.distill.enabled  # (GAE, or distillation's per-token advantages)
    shapes["advantages"] = ((rows, length) if per_token else (rows,), jnp.float32)
    if vision := c.model.model_config().vision:  # a VLM's prompt images (`prompt_image_spec`)
        slots = prompt_slots(vision, c.rollout.max_prompt_len, c.data.max_images)
        shapes |= _images(c, rows, length, slots)
    if routes := route_shape(c.loss.router_replay, c.model.model_config()):  # router replay
        shapes["routed_experts"] = ((rows, length, *routes), jnp.int16)
    return _abstract(shapes, mesh), rows * length, length


def _rl_resident(c, model_config, mesh) -> dict:
    """GRPO/PPO's frozen reference (the LoRA base with adapters off costs nothing more), the
    merged weights a LoRA policy samples with, and the rollout KV cache (co-located sampler)."""
    out = {}
    full = param_shardings(model_config, mesh)
    if c.kl.enabled and c.lora is None:
        out["reference"] = bytes_per_device(param_shapes(model_config), full)
    if c.rollout.sampler_devices:
        return out
    if c.lora is not None:
        out["sampler weights (merged)"] = bytes_per_device(param_shapes(model_config), full)
    m = model_config
    length = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    sizes = dict(mesh.shape)
    batch_split = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    heads, k_dim, v_dim = m.cache_dims()  # MLA: one latent per token
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    cache = m.num_layers * c.rows * length * heads * (k_dim + v_dim) * itemsize
    out["KV cache"] = cache / (min(batch_split, c.rows) * min(sizes["tensor"], heads))
    return out


def _sft_run(config, workdir, **kwargs) -> dict:
    """SFT with its periodic eval suite, built here: eval sits beside train, not below it."""
    suite = suite_evaluator(config.eval_suite) if config.eval_suite else None
    return run_sft(config, workdir, suite=suite, **kwargs)


def _rl(name: str) -> Method:
    return Method(
        name=name,
        config=RLConfig,
        run=run_rl,
        plan=lambda c, m, mesh, domains: rl_plan(c, m, mesh, domains)[0],
        frozen=_policy_frozen,
        batch=_rl_batch,
        rows=lambda c: c.rows // c.algorithm.minibatches,
        devices=lambda c, devices: split_devices(c, devices)[0],
        resident=_rl_resident,
    )


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            name="sft",
            config=SFTConfig,
            run=_sft_run,
            plan=lambda c, m, mesh, domains: sft_plan(c, m, mesh),
            frozen=_policy_frozen,
            batch=_sft_batch,
            rows=lambda c: c.data.batch_size,
        ),
        Method(
            name="dpo",
            config=DPOConfig,
            run=run_dpo,
            plan=dpo_plan,
            frozen=_dpo_frozen,
            batch=_dpo_batch,
            rows=lambda c: c.data.batch_size,
        ),
        Method(  # rounds of on-policy pairs (posttrain.rl._pairs) and DPO
            name="iterative_dpo",
            config=IterativeDPOConfig,
            run=run_iterative_dpo,
            plan=dpo_plan,
            frozen=_dpo_frozen,
            batch=_dpo_batch,
            rows=lambda c: c.data.batch_size,
        ),
        Method(
            name="rm",
            config=RewardModelConfig,
            run=run_reward_model,
            plan=rm_plan,
            frozen=_rm_frozen,
            batch=_preference_batch,
            rows=lambda c: c.data.batch_size,
            lm_head=False,
        ),
        _rl("grpo"),
        _rl("ppo"),
    )
}


def get(name: str) -> Method:
    """The method a config's `method` names."""
    if name not in METHODS:
        raise ConfigError(f"method {name!r} is not available; available: {', '.join(METHODS)}")
    return METHODS[name]


def method_config(config) -> tuple[Method, Any]:
    """(the method, its built config) of a loaded ConfigDict (`method` defaults to "sft")."""
    values = dict(to_plain(config))
    method = get(values.pop("method", "sft"))
    return method, build(method.config, values)


def run_from_config(config, workdir: str, **kwargs) -> dict:
    """Runs the method the config names in `workdir` (`kwargs`: the run's, e.g. on_metrics)."""
    method, built = method_config(config)
    with run_lock(workdir):  # released however the run ends, even before its loop starts
        return method.run(built, workdir, **kwargs)
