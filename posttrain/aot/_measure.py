"""Lowering a method's step (and the programs beside it) onto a slice's devices, compiling it
with libtpu and measuring memory, FLOPs and collectives (`measure`); the smallest slice a
plan fits (`smallest_fit`)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from posttrain import _collectives
from posttrain._collectives import collectives, summary
from posttrain._flops import _expected_ratio, _expert_buffer, matmul_flops
from posttrain.aot._report import CompileReport
from posttrain.aot._slices import CHIPS, FIT_FRACTION, Chip, parse_topology
from posttrain.config import ConfigError
from posttrain.models import bubble_fraction
from posttrain.parallel import axis_rules


@dataclasses.dataclass(frozen=True)
class Program:
    """A program a method runs beside its step, compiled with it: `fn` (jitted) lowered on
    `args` (abstract, sharded) and `static` keyword arguments; `shared`: bytes per device of
    its arguments that the step's state already holds (the weights); `label` says what it
    is in the report."""

    fn: Callable
    args: tuple
    static: dict
    shared: float
    label: str


@dataclasses.dataclass(frozen=True)
class Lowering:
    """A method's train step, ready to lower onto a mesh (built by `posttrain.methods`).

    Attributes:
      method: the label the report gives ("sft", "dpo (LoRA r=16, ...)").
      mesh: the step's device mesh; axis_rules: the config's logical-axis rules.
      step: `(state, frozen inputs, batch) -> (state, metrics)`, the function a run jits.
      state, state_shardings: the train state's abstract arrays and their shardings.
      inputs: the step's named frozen inputs (abstract, sharded); batch: one global batch.
      tokens, length: tokens of one step, and the sequence length (for model FLOPs).
      resident: bytes per device the method keeps beside the step, by name.
      model_config: the trained model's config; lm_head: whether the step computes its
        vocabulary logits (not a reward model's trunk), for the model's FLOPs.
      also_trained: `(model config, lm_head)` of each other model the step trains on the same
        tokens (PPO's critic), counted in the model's FLOPs too.
      epochs: passes the step makes over its batch (RL's `algorithm.epochs`): each token is
        trained on this many times.
      images: a VLM's image slots in one pass over the batch (each encoded, its features
        projected), and encoder_trained: whether the image encoder trains (not frozen).
      programs: what the method runs beside the step, compiled and measured too (`Program`).
    """

    method: str
    mesh: Any
    axis_rules: Any
    step: Callable
    state: Any
    state_shardings: Any
    inputs: dict
    batch: dict
    tokens: int
    length: int
    resident: dict
    model_config: Any
    lm_head: bool = True
    also_trained: tuple = ()
    epochs: int = 1
    images: int = 0
    encoder_trained: bool = True
    programs: dict = dataclasses.field(default_factory=dict)

    def jitted(self):
        """The step as a run jits it (donated state; frozen inputs keep their shardings)."""
        return jax.jit(self.step, out_shardings=(self.state_shardings, None), donate_argnums=0)

    def arguments(self) -> tuple:
        return (self.state, self.inputs, self.batch)


def bytes_per_device(shapes, shardings) -> float:
    """Bytes one device holds of `shapes` laid out by `shardings`."""
    total = 0.0
    for s, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings), strict=True):
        if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
            continue  # the PRNG key: a few bytes
        total += math.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize
    return total


class _TooLarge(Exception):
    """The step's arguments alone exceed HBM: no compile is needed to know it does not fit."""


def _compile_uncached(lowered, options: dict | None = None):
    """Compiles for the slice (with libtpu compile `options`) with JAX's persistent compilation
    cache off: libtpu's compile-only client writes its executables there but cannot read them
    back ("PjRtCompiler must be constructed with a Client"), so a cached plan would only cost a
    write and a warning."""
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        return lowered.compile(compiler_options=options)
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile(compiler_options=options)
    finally:  # the rest of the process compiles as before
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def _compile_choosing_flags(lowered) -> tuple[Any, str]:
    """(executable, which libtpu flags): `_collectives.compile_choosing_flags` on the slice."""
    return _collectives.compile_choosing_flags(lambda options: _compile_uncached(lowered, options))


def measure(lowering: Lowering, topology: str, generation: str) -> CompileReport:
    """Compiles `lowering` (on a slice of `generation`, named `topology` in the report) and
    measures its memory, FLOPs and roofline step time."""
    import time

    low = lowering
    sharding_of = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    with axis_rules(low.axis_rules), jax.set_mesh(low.mesh):
        step = low.jitted()
        start = time.perf_counter()
        lowered = step.lower(*low.arguments())
        kernels = lowered.as_text().count("tpu_custom_call")  # Pallas kernels (splash)
        state_bytes = bytes_per_device(low.state, low.state_shardings)
        state_bytes += bytes_per_device(low.inputs, sharding_of(low.inputs))
        batch_bytes = bytes_per_device(low.batch, sharding_of(low.batch))
        chip, compiled_ok, flags = CHIPS[generation], True, "none (not compiled)"
        try:
            if state_bytes + batch_bytes > FIT_FRACTION * chip.hbm_bytes:
                raise _TooLarge  # no compile needed to know (a quick smallest-slice search)
            compiled, flags = _compile_choosing_flags(lowered)
            memory = compiled.memory_analysis()
            sizes = (
                memory.argument_size_in_bytes,
                memory.output_size_in_bytes,
                memory.temp_size_in_bytes,
                memory.alias_size_in_bytes,
            )
            host = float(getattr(memory, "host_temp_size_in_bytes", 0))
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list | tuple) else cost
            communication = _communication(compiled.as_text(), low.mesh, topology, chip)
        except _TooLarge:
            host = 0.0
            sizes = (state_bytes + batch_bytes, state_bytes, 0.0, state_bytes)
            cost, compiled_ok, communication = {}, False, {}
        except jax.errors.JaxRuntimeError as e:
            # XLA refuses a program whose buffers exceed HBM; it says how much they need.
            found = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", str(e))
            if "RESOURCE_EXHAUSTED" not in str(e) or not found:
                raise
            temporaries = float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024
            sizes = (state_bytes + batch_bytes, state_bytes, temporaries, state_bytes)
            cost, host, communication = {}, 0.0, {}
        seconds = time.perf_counter() - start
        programs = {name: _measure_program(p, chip, state_bytes)
                    for name, p in low.programs.items()}  # fmt: skip
        program = matmul_flops(jax.make_jaxpr(step)(*low.arguments()).jaxpr)
        expert_buffer = _expert_buffer(low.model_config, low.mesh)
    model_config, length = low.model_config, low.length
    trained = ((model_config, low.lm_head), *low.also_trained)
    tokens = low.epochs * low.tokens  # (tokens trained on, with each model in `trained`)
    model_flops = tokens * sum(m.flops_per_token(length, head) for m, head in trained)
    attention = model_flops - tokens * sum(m.flops_per_token(0, head) for m, head in trained)
    if low.images:  # (the image slots' encoder and projector FLOPs are not per token)
        per_image = model_config.vision.flops_per_image(
            model_config.embed_dim, encoder_trained=low.encoder_trained
        )
        model_flops += low.epochs * low.images * per_image
    # A fused attention kernel's FLOPs are not matmuls in the program: add the formula's.
    program_flops = program + (attention if kernels else 0.0)
    devices = low.mesh.devices.size
    return CompileReport(
        topology=topology,
        chips=devices,
        chip=chip,
        method=low.method,
        arguments=float(sizes[0]),
        outputs=float(sizes[1]),
        temporaries=float(sizes[2]),
        aliased=float(sizes[3]),
        resident=low.resident,
        model_flops=model_flops,
        compiled_flops=program_flops,
        xla_flops=float(cost.get("flops", 0.0)) * devices,
        expected_ratio=_expected_ratio(model_config, length, expert_buffer, low.lm_head),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        flags=flags,
        compile_seconds=seconds,
        compiled=compiled_ok,
        host_temporaries=host,
        bubble=bubble_fraction(
            dict(low.mesh.shape).get("stage", 1), model_config.pipeline_microbatches
        ),
        schedule=model_config.pipeline_schedule,
        communication=communication,
        remat=model_config.remat,
        programs=programs,
        state=state_bytes,
    )


def _measure_program(program: Program, chip: Chip, state_bytes: float) -> dict:
    """A `Program` compiled (under the caller's mesh and rules): its memory per device; not
    compiled where its own arguments beside the step's state already exceed HBM (a KV pool too
    large: no compile needed to know)."""
    import time

    start = time.perf_counter()
    out = {"label": program.label, "shared": program.shared, "compiled": True}
    arguments = bytes_per_device(program.args, jax.tree.map(lambda x: x.sharding, program.args))
    if state_bytes + arguments - program.shared > FIT_FRACTION * chip.hbm_bytes:
        out.update(arguments=arguments, outputs=0.0, temporaries=0.0, aliased=0.0,
                   compiled=False, seconds=time.perf_counter() - start)  # fmt: skip
        return out
    lowered = program.fn.lower(*program.args, **program.static)
    try:
        compiled, out["flags"] = _compile_choosing_flags(lowered)
        memory = compiled.memory_analysis()
        out.update(
            arguments=float(memory.argument_size_in_bytes),
            outputs=float(memory.output_size_in_bytes),
            temporaries=float(memory.temp_size_in_bytes),
            aliased=float(memory.alias_size_in_bytes),
        )
    except jax.errors.JaxRuntimeError as e:  # over HBM: XLA says how much it needs
        found = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or not found:
            raise
        temporaries = float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024
        out.update(arguments=arguments, outputs=0.0, temporaries=temporaries, aliased=0.0,
                   compiled=False)  # fmt: skip
    out["seconds"] = time.perf_counter() - start
    return out


def _communication(hlo: str, mesh, topology: str, chip: Chip) -> dict:
    """The compiled program's collectives timed on the slice (`posttrain._collectives`)."""
    devices = list(mesh.devices.flat)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    slice_of = (lambda i: getattr(devices[i], "slice_index", 0)) if len(slices) > 1 else None
    generation = topology.split()[-1]  # "2 x v5p-256" -> "v5p-256"
    torus = [int(x) for x in parse_topology(generation)[2].split(":")[1].split("x")]
    found = collectives(hlo, devices=len(devices), slice_of=slice_of, torus=torus)
    return summary(found, chip.ici_port, chip.dcn_bandwidth)


def smallest_fit(compile_plan: Callable, config, generation: str, *, start_chips: int = 4,
                 max_chips: int = 8192):  # fmt: skip
    """The smallest slice of `generation` (doubling from `start_chips`) the plan fits on, with
    its report, or (None, last report); `compile_plan(config, topology)` makes each report.
    The config's mesh must adapt (an axis of -1)."""
    chip = CHIPS[generation]
    chips, report = start_chips, None
    while chips <= max_chips:
        try:
            report = compile_plan(config, f"{generation}-{chips * chip.cores_per_chip}")
        except (ValueError, ConfigError):
            report = None  # the mesh does not divide this slice: try the next size
        if report is not None and report.fits:
            return f"{generation}-{chips * chip.cores_per_chip}", report
        chips *= 2
    return None, report
