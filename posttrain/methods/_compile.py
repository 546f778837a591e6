"""`posttrain compile` of a method: the step its run jits, lowered for a TPU slice."""

from __future__ import annotations

import copy
import math

import jax
from tqdm.auto import tqdm

from posttrain import aot
from posttrain.config import override
from posttrain.methods._record import config_domains, method_config
from posttrain.models import param_shapes, with_shardings
from posttrain.parallel import axis_rules, make_mesh
from posttrain.train import check_batching, frozen_mask, make_step


def lowering(config, devices, domains=None, *, programs: bool = True) -> aot.Lowering:
    """The configured method's train step on a mesh of `devices` (TPU topology devices for a
    plan, or real ones), with abstract state, frozen inputs and batch: the function
    `posttrain.train._run.train` jits, from the method's own `StepPlan`. `domains`: those
    the step names (default: the config's sources'; a run adds those its records name).
    `programs`: with what the method runs beside the step (RL: the sampler's decode call).

    Raises:
      ConfigError: the config, or a mesh or batch that does not fit the devices.
    """
    method, c = method_config(config)
    model_config = c.model.model_config()
    mesh = make_mesh(c.mesh, method.devices(c, devices))
    check_batching(method.rows(c), c.train.micro_batches, mesh)  # as a run would
    with axis_rules(c.mesh.axis_rules):
        # Outside the TPU mesh context: optax builds the state's tree on the host.
        plan = method.plan(c, model_config, mesh, domains or config_domains(c))
        step, _, abstract, shardings = make_step(c, plan, mesh)
        batch, tokens, length = method.batch(c, mesh)
        inputs = method.frozen(c, model_config, mesh)
        resident = method.resident(c, model_config, mesh)
        beside = method.programs(c, model_config, mesh) if programs else {}
    label = method.name
    if c.lora is not None:
        stored = f", {c.lora.quantize} base" if c.lora.quantize else ""
        label = f"{label} (LoRA r={c.lora.rank}{stored}, frozen base in the arguments)"
    return aot.Lowering(
        method=label,
        mesh=mesh,
        axis_rules=c.mesh.axis_rules,
        step=step,
        state=with_shardings(abstract, shardings),
        state_shardings=shardings,
        inputs=inputs,
        batch=batch,
        tokens=tokens,
        length=length,
        resident=resident,
        model_config=model_config,
        lm_head=method.lm_head,
        also_trained=method.also_trained(c, model_config),
        epochs=method.epochs(c),
        images=_image_slots(batch),
        encoder_trained=_encoder_trained(c.model.freeze, model_config),
        programs=beside,
    )


def compile_plan(
    config, topology: str, *, num_slices: int = 1, programs: bool = True
) -> aot.CompileReport:
    """Compiles the configured method's train step (and with `programs` what it runs beside
    it: RL's sampler) for `topology` and measures them.

    Args:
      config: a loaded config (`load_config_file("configs/<method>.py:<preset>")`).
      topology: e.g. "v5p-1024" (512 chips), "v6e-256", "v5e-8".
      num_slices: slices joined over DCN (the config's `mesh.dcn` spans them).

    Raises:
      ConfigError: an unknown topology, or a mesh that does not fit its devices.
      ImportError: libtpu is not installed (install the `tpu` extra).
    """
    generation, devices = aot.topology_devices(topology, num_slices)
    name = topology if num_slices == 1 else f"{num_slices} x {topology}"
    return aot.measure(lowering(config, devices, programs=programs), name, generation)


def _image_slots(batch: dict) -> int:
    """Image slots in one pass over the step's batch (a VLM's `images` `[rows, slots, ...]`)."""
    return math.prod(batch["images"].shape[:2]) if "images" in batch else 0


def _encoder_trained(freeze: tuple, model_config) -> bool:
    """Whether `model.freeze` leaves any of a VLM's image encoder's patch embedding, positions
    or layers to train (then the backward runs through its layers; a final norm alone, as
    Gemma 3's configs leave it, needs no matmul of it)."""
    if model_config.vision is None:
        return False
    held = frozen_mask(tuple(freeze), param_shapes(model_config))
    if held is None:
        return True
    encoder = {
        k: v for k, v in held["vision"].items() if k.startswith(("patch", "position", "layers"))
    }
    return not all(jax.tree.leaves(encoder))


REMAT_SWEEP = ("full", "dots_no_batch", "dots", "offload_dots", "none")  # most saved last


def remat_sweep(config, topology: str, *, num_slices: int = 1, known=None, progress=False):
    """The plan compiled once per layer remat policy (`REMAT_SWEEP`): {policy: report}, for
    `posttrain.aot.remat_lines` / `fastest_fit`. `known`: a report of this plan already
    compiled (under its own policy), reused. `progress`: a bar over the compiles. (The
    programs beside the step do not depend on the policy: compiled once, with `known`.)"""
    reports = {}
    for policy in tqdm(REMAT_SWEEP, desc="remat sweep", disable=not progress, leave=False):
        if known is not None and known.remat == policy:
            reports[policy] = known
        else:
            changed = override(copy.deepcopy(config), {"model.remat": policy})
            reports[policy] = compile_plan(changed, topology, num_slices=num_slices, programs=False)
    return reports


def smallest_fit(config, generation: str, **kwargs):
    """`posttrain.aot.smallest_fit` of the configured method."""
    return aot.smallest_fit(compile_plan, config, generation, **kwargs)
