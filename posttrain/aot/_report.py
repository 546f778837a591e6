"""What `posttrain compile` reports of a plan (`CompileReport`: per-device memory of the step
and of the programs beside it, FLOPs, collectives, roofline step time and MFU), and what it
concludes from reports: the fastest remat policy that fits, what to change when none does."""

from __future__ import annotations

import dataclasses

from posttrain.aot._slices import FIT_FRACTION, Chip, GiB


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
    schedule: str = "gpipe"  # the pipeline's schedule (ModelConfig.pipeline_schedule)
    # The program's collectives by kind (`posttrain._collectives.summary`): runs, bytes moved
    # per device, seconds at the slice's ICI / DCN bandwidth, and how much of it is async.
    communication: dict = dataclasses.field(default_factory=dict)
    remat: str = ""  # the model's layer remat policy in this program
    flags: str = "default"  # the libtpu flag set the step compiled with, and why
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
            f"  libtpu flags  {self.flags}",
            f"  arguments     {gib(self.arguments)}  (params, optimizer state, batch)",
            f"  outputs       {gib(self.outputs)}  (aliased with donated inputs: "
            f"{self.aliased / GiB:.2f} GiB)",
            f"  temporaries   {gib(self.temporaries)}",
        ]
        if self.bubble:
            out.append(f"  pipeline bubble {100 * self.bubble:.0f}% of the step ({self.schedule}: "
                       "stages - 1 idle ticks per microbatches + stages - 1)")  # fmt: skip
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
                + (
                    f"compiled in {p['seconds']:.0f} s, libtpu flags {p['flags']}"
                    if p["compiled"]
                    else "not compiled"
                ),
                f"  arguments     {gib(p['arguments'])}  (of which the weights, shared with the "
                f"step: {p['shared'] / GiB:.2f} GiB)",
                f"  temporaries   {gib(p['temporaries'])}",
                f"  total         {gib(total)}  of {self.capacity / GiB:.0f} GiB "
                f"({100 * total / self.capacity:.0f}%), beside the step's state and the "
                "resident extras",
            ]
        return out


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
