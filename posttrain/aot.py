"""Ahead-of-time compilation of a run's train step for a TPU slice, from a CPU host.

    posttrain compile --config=configs/sft.py:llama3_8b_v5p --topology=v5p-64
    report = compile_plan(load_config_file("configs/sft.py:llama3_8b_v5p"), "v5p-64")  # methods

The real step of the configured method (SFT, DPO or GRPO/PPO) is lowered with abstract params,
optimizer state and batch (nothing is allocated) onto the devices of
`jax.experimental.topologies` for that slice and compiled by libtpu (the `tpu` extra). The
report gives XLA's per-device memory (arguments, outputs, temporaries), what the method keeps
resident beside the step (a frozen reference, the rollout KV cache), the model's and the
compiled FLOPs, and a roofline step time and MFU from the chip's peak. A plan "fits" when the
per-device total stays under 95% of the chip's HBM (the rest is left to the runtime).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from posttrain._collectives import collectives, summary
from posttrain._flops import _expected_ratio, _expert_buffer, matmul_flops
from posttrain.config import ConfigError
from posttrain.models import bubble_fraction
from posttrain.parallel import axis_rules

GiB = 1024**3
FIT_FRACTION = 0.95  # of HBM; the rest is the runtime's (programs, buffers, fragmentation)


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation: its HBM, dense bf16 peak, memory bandwidth and slice geometry."""

    name: str
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float  # bytes/s
    dims: int  # torus dimensions of a slice (3 for v4/v5p, 2 for v5e/v6e)
    cores_per_chip: int  # the slice name counts TensorCores (v4/v5p: 2 per chip)
    ici_bandwidth: float  # bytes/s, bidirectional, all of a chip's ICI ports together
    dcn_bandwidth: float  # bytes/s of data-center network per chip (its host's NICs / chips)

    @property
    def ici_port(self) -> float:
        """Bidirectional bytes/s of one ICI port (a torus dimension's ring uses two)."""
        return self.ici_bandwidth / (2 * self.dims)


# Google Cloud's published figures: ICI per chip (v5p 1,200 GB/s bidirectional; v5e 1,600
# Gbps, v6e 3,584 Gbps; v4 2,400 Gbps), DCN per chip (v5p 50 Gbps; v5e 2 x 100 Gbps and v6e
# 4 x 200 Gbps NICs per 8-chip host; v4 taken as v5p's).
CHIPS = {
    "v5p": Chip("TPU v5p", 95 * GiB, 459e12, 2.765e12, 3, 2, 1200e9, 6.25e9),
    "v5e": Chip("TPU v5e", 16 * GiB, 197e12, 0.819e12, 2, 1, 200e9, 3.125e9),
    "v6e": Chip("TPU v6e", 32 * GiB, 918e12, 1.64e12, 2, 1, 448e9, 12.5e9),
    "v4": Chip("TPU v4", 32 * GiB, 275e12, 1.2e12, 3, 2, 300e9, 6.25e9),
}


def parse_topology(name: str) -> tuple[str, int, str]:
    """`"v5p-1024"` -> ("v5p", 512 chips, "v5p:8x8x8"), the name libtpu's topologies take."""
    match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise ConfigError(
            f"--topology={name!r}: use <generation>-<size> with generation v4, v5p, v5e or v6e, "
            "e.g. v5p-1024 (512 chips), v6e-256, v5e-8"
        )
    generation, size = match.group(1), int(match.group(2))
    chip = CHIPS[generation]
    chips = size // chip.cores_per_chip
    if chips < 1 or chips & (chips - 1) or size % chip.cores_per_chip:
        raise ConfigError(f"--topology={name!r}: the slice size must give a power-of-two chips")
    # The most cube-like power-of-two shape: 8 chips 2x2x2 (v5p) or 2x4 (v5e), 4 chips 2x2x1.
    shape = [1] * chip.dims
    for i in range(int(math.log2(chips))):
        shape[i % chip.dims] *= 2
    shape = sorted(shape) if chip.dims == 2 else sorted(shape, reverse=True)
    if chip.dims == 3 and shape[-1] > 1:
        shape = sorted(shape)
    return generation, chips, f"{generation}:" + "x".join(map(str, shape))


@dataclasses.dataclass
class CompileReport:
    """What `compile_plan` measured; all memory figures are bytes per device."""

    topology: str
    chips: int
    chip: Chip
    method: str
    arguments: float
    outputs: float
    temporaries: float
    aliased: float
    resident: dict  # what the method keeps beside the step: {name: bytes}
    model_flops: float  # per step, all chips (6 N tokens + attention, per the model)
    compiled_flops: float  # per step, all chips: the program's matmuls (scan/remat aware)
    xla_flops: float  # XLA's cost analysis x chips (counts each loop body once)
    expected_ratio: float  # compiled / model FLOPs the remat policy explains
    bytes_accessed: float  # per device per step
    compile_seconds: float
    compiled: bool = True  # False: the arguments alone exceed HBM, XLA was not asked
    host_temporaries: float = 0.0  # activations offloaded to host memory (remat=offload_dots)
    bubble: float = 0.0  # pipeline stages' idle share of the step (mesh stage > 1)
    # The program's collectives by kind (`posttrain._collectives.summary`): runs, bytes moved
    # per device, seconds at the slice's ICI / DCN bandwidth, and how much of it is async.
    communication: dict = dataclasses.field(default_factory=dict)
    remat: str = ""  # the model's layer remat policy in this program
    # Programs the method runs beside the step (RL: the co-located sampler's decode call),
    # compiled too: {name: {"label", "arguments", "outputs", "temporaries", "aliased",
    # "shared" (bytes of its arguments the step's state holds: the weights), "seconds"}}.
    programs: dict = dataclasses.field(default_factory=dict)
    # Bytes per device the step's state and frozen inputs hold (what stays while a program
    # beside it runs).
    state: float = 0.0

    @property
    def total(self) -> float:
        """Per-device peak: the step's buffers (donated inputs reused) plus resident extras."""
        return (
            self.arguments + self.outputs + self.temporaries - self.aliased
            + sum(self.resident.values())
        )  # fmt: skip

    def program_total(self, name: str) -> float:
        """Per-device peak while program `name` runs: the step's state and frozen inputs, the
        resident extras, and the program's own buffers beyond the weights it shares."""
        p = self.programs[name]
        own = p["arguments"] - p["shared"] + p["outputs"] + p["temporaries"] - p["aliased"]
        return self.state + sum(self.resident.values()) + own

    @property
    def capacity(self) -> float:
        return self.chip.hbm_bytes

    @property
    def fits(self) -> bool:
        """The step fits, and so does every program beside it."""
        peaks = [self.total, *map(self.program_total, self.programs)]
        return max(peaks) <= FIT_FRACTION * self.capacity

    @property
    def compute_seconds(self) -> float:
        """Roofline of one chip: the larger of compute time and HBM traffic time."""
        return max(
            self.compiled_flops / self.chips / self.chip.peak_flops,
            self.bytes_accessed / self.chip.hbm_bandwidth,
        )

    @property
    def communication_seconds(self) -> tuple[float, float]:
        """(synchronous, async) seconds of the step's collectives."""
        total = self.communication.get("total", {})
        overlappable = total.get("overlappable_seconds", 0.0)
        return total.get("seconds", 0.0) - overlappable, overlappable

    @property
    def step_seconds(self) -> float:
        """Compute (or HBM) time, plus the synchronous collectives, with the async ones hidden
        under compute as far as it lasts."""
        exposed, overlappable = self.communication_seconds
        return max(self.compute_seconds, overlappable) + exposed

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.chips * self.chip.peak_flops * self.step_seconds)

    @property
    def compute_mfu(self) -> float:
        """MFU from compute and HBM traffic alone (communication free)."""
        return self.model_flops / (self.chips * self.chip.peak_flops * self.compute_seconds)

    def lines(self) -> list[str]:
        gib = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        out = [
            f"{self.method} train step on {self.topology} ({self.chips} x {self.chip.name}, "
            f"{self.capacity / GiB:.0f} GiB HBM each), "
            + (
                f"compiled in {self.compile_seconds:.0f} s"
                if self.compiled
                else "not compiled: params, optimizer state and batch alone exceed HBM"
            ),
            f"  arguments     {gib(self.arguments)}  (params, optimizer state, batch)",
            f"  outputs       {gib(self.outputs)}  (aliased with donated inputs: "
            f"{self.aliased / GiB:.2f} GiB)",
            f"  temporaries   {gib(self.temporaries)}",
        ]
        if self.bubble:
            out.append(f"  pipeline bubble {100 * self.bubble:.0f}% of the step (GPipe: stages - 1 "
                       "idle ticks per microbatches + stages - 1)")  # fmt: skip
        if self.host_temporaries:
            out.append(f"  host memory   {gib(self.host_temporaries)}  (offloaded activations, "
                       "not in HBM)")  # fmt: skip
        out += [f"  {name:<13} {gib(size)}" for name, size in self.resident.items()]
        out += [
            f"  total         {gib(self.total)}  of {self.capacity / GiB:.0f} GiB "
            f"({100 * self.total / self.capacity:.0f}%)",
            f"  model FLOPs / step     {self.model_flops:.3e}",
            f"  compiled FLOPs / step  {self.compiled_flops:.3e}  "
            f"(x{self.compiled_flops / self.model_flops:.2f} of the model's; remat and expert "
            f"buffers explain x{self.expected_ratio:.2f})",
            f"  XLA cost analysis      {self.xla_flops:.3e}  (loop bodies counted once)",
        ]
        for kind, row in self.communication.items():
            if kind != "total":
                out.append(f"  {kind:<22} {row['runs']:6.0f} runs, {row['bytes'] / GiB:8.3f} GiB "
                           f"per chip, {row['seconds']:.3f} s" + (
                               f" ({row['dcn_seconds']:.3f} s over DCN)"
                               if row["dcn_seconds"] else ""))  # fmt: skip
        exposed, overlappable = self.communication_seconds
        share = exposed + max(0.0, overlappable - self.compute_seconds)  # not under compute
        out += [
            f"  roofline step time     {self.step_seconds:.3f} s = compute/HBM "
            f"{self.compute_seconds:.3f} s + collectives {exposed:.3f} s synchronous"
            + (f", {overlappable:.3f} s async" if overlappable else ""),
            f"  MFU                    {100 * self.mfu:.0f}% (collectives "
            f"{100 * share / self.step_seconds:.0f}% of the step; compute and HBM alone: "
            f"{100 * self.compute_mfu:.0f}%)",
        ]
        for name, p in self.programs.items():
            total = self.program_total(name)
            out += [
                f"{name}: {p['label']}, "
                + (f"compiled in {p['seconds']:.0f} s" if p["compiled"] else "not compiled"),
                f"  arguments     {gib(p['arguments'])}  (of which the weights, shared with the "
                f"step: {p['shared'] / GiB:.2f} GiB)",
                f"  temporaries   {gib(p['temporaries'])}",
                f"  total         {gib(total)}  of {self.capacity / GiB:.0f} GiB "
                f"({100 * total / self.capacity:.0f}%), beside the step's state and the "
                "resident extras",
            ]
        return out


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
    programs: dict = dataclasses.field(default_factory=dict)

    def jitted(self):
        """The step as a run jits it (donated state; frozen inputs keep their shardings)."""
        return jax.jit(self.step, out_shardings=(self.state_shardings, None), donate_argnums=0)

    def arguments(self) -> tuple:
        return (self.state, self.inputs, self.batch)


def topology_devices(topology: str, num_slices: int = 1):
    """(generation, devices) of a TPU slice from libtpu's topologies (nothing runs on them).

    Raises:
      ConfigError: an unknown topology, or fewer than one slice.
      ImportError: libtpu is not installed (install the `tpu` extra).
    """
    from jax.experimental import topologies

    if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
        raise ConfigError(f"num_slices={num_slices}: a plan spans 1 or more slices (over DCN)")

    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise ImportError("posttrain compile needs libtpu: pip install 'posttrain[tpu]'") from e
    # libtpu takes a host-wide lock when loaded; compiling from several processes at once (a
    # sweep of plans) needs it shared. Nothing here drives a real TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    generation, _, name = parse_topology(topology)
    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    return generation, topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                    **kwargs).devices  # fmt: skip


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


def _compile_uncached(lowered):
    """Compiles for the slice with JAX's persistent compilation cache off: libtpu's compile-only
    client writes its executables there but cannot read them back ("PjRtCompiler must be
    constructed with a Client"), so a cached plan would only cost a write and a warning."""
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        return lowered.compile()
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile()
    finally:  # the rest of the process compiles as before
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


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
        chip, compiled_ok = CHIPS[generation], True
        try:
            if state_bytes + batch_bytes > FIT_FRACTION * chip.hbm_bytes:
                raise _TooLarge  # no compile needed to know (a quick smallest-slice search)
            compiled = _compile_uncached(lowered)
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
        programs = {name: _measure_program(p) for name, p in low.programs.items()}
        program = matmul_flops(jax.make_jaxpr(step)(*low.arguments()).jaxpr)
        expert_buffer = _expert_buffer(low.model_config, low.mesh)
    model_config, tokens, length = low.model_config, low.tokens, low.length
    model_flops = model_config.flops_per_token(length, low.lm_head) * tokens
    attention = model_flops - model_config.flops_per_token(0, low.lm_head) * tokens
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
        compile_seconds=seconds,
        compiled=compiled_ok,
        host_temporaries=host,
        bubble=bubble_fraction(
            dict(low.mesh.shape).get("stage", 1), model_config.pipeline_microbatches
        ),
        communication=communication,
        remat=model_config.remat,
        programs=programs,
        state=state_bytes,
    )


def _measure_program(program: Program) -> dict:
    """A `Program` compiled (under the caller's mesh and rules): its memory per device."""
    import time

    start = time.perf_counter()
    lowered = program.fn.lower(*program.args, **program.static)
    out = {"label": program.label, "shared": program.shared, "compiled": True}
    try:
        memory = _compile_uncached(lowered).memory_analysis()
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
        arguments = bytes_per_device(program.args, jax.tree.map(lambda x: x.sharding, program.args))
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


def fastest_fit(reports: dict[str, CompileReport]) -> str | None:
    """The remat policy (a key of `reports`, one compile of the plan each) with the shortest
    roofline step among those that fit; within 1% of it, the one that needs less HBM.
    `offload_dots` is not ranked: its step also moves the saved activations to host memory and
    back, which the roofline does not time."""
    timed = {p: r for p, r in reports.items() if r.fits and r.compiled and not r.host_temporaries}
    if not timed:
        return None
    best = min(r.step_seconds for r in timed.values())
    close = [p for p, r in timed.items() if r.step_seconds <= 1.01 * best]
    return min(close, key=lambda p: timed[p].total)


def remat_lines(reports: dict[str, CompileReport]) -> list[str]:
    """A table of one plan compiled once per remat policy, and the fastest that fits."""
    out = ["remat policy    per-chip total       fits  FLOPs vs model  roofline step  MFU"]
    for policy, r in reports.items():
        memory = f"{r.total / GiB:7.2f} GiB ({100 * r.total / r.capacity:3.0f}%)"
        host = f", + {r.host_temporaries / GiB:.1f} GiB on host" if r.host_temporaries else ""
        # (a plan that does not fit has no program to read collectives from: no step time)
        timing = f"{r.step_seconds:9.3f} s  {100 * r.mfu:3.0f}%" if r.fits else "        -      -"
        out.append(
            f"{policy:<15} {memory}  {'yes' if r.fits else 'no ':<4}  "
            f"x{r.compiled_flops / r.model_flops:<13.2f}  {timing}{host}"
        )
    best = fastest_fit(reports)
    if best is None:
        out.append("no policy fits this slice (offload_dots aside)")
    else:
        r = reports[best]
        out.append(
            f"fastest that fits: {best} (--config.model.remat={best}), roofline step "
            f"{r.step_seconds:.3f} s; offload_dots's host transfers are not timed"
        )
    return out


def suggestion(report: CompileReport) -> str:
    """What to change when a plan does not fit."""
    over = [n for n in report.programs if report.program_total(n) > FIT_FRACTION * report.capacity]
    if over and report.total <= FIT_FRACTION * report.capacity:
        need = report.program_total(over[0])
        return (
            f"the step fits, but {over[0]} needs {need / GiB:.1f} GiB per chip of the "
            f"{FIT_FRACTION:.0%} of {report.capacity / GiB:.0f} GiB available: decode fewer rows "
            "at once (rollout.engine.slots), a smaller KV pool (rollout.engine.num_blocks, "
            "rollout.engine.kv_dtype=int8), shard the KV heads (mesh tensor), or sample on "
            "devices of its own (rollout.sampler_devices)"
        )
    return (
        f"needs {report.total / GiB:.1f} GiB per chip but {FIT_FRACTION:.0%} of "
        f"{report.capacity / GiB:.0f} GiB is available: shard more (mesh.ici.fsdp=-1 over all "
        "chips, or more tensor), set model.remat=full, lower data.batch_size per micro-batch "
        "(raise train.micro_batches), use bfloat16 params (model.param_dtype), or a larger slice"
    )
