"""The collectives of a compiled program, read from its optimized HLO, and their time on a slice.

`posttrain compile` counts FLOPs and HBM traffic; what a sharded step also pays is communication:
the all-gathers of FSDP weights, the reduce-scatters of their gradients, tensor parallelism's
all-reduces, MoE's all-to-alls. `collectives(hlo_text)` lists every collective op with the
number of times it runs per step (a loop body's ops times the loop's trip count), its bytes and
its replica groups; `Collective.seconds` times one at the bandwidth its group reaches: ICI when
its devices share a slice, DCN when they span slices.

The model is the usual ring estimate (per device, a group of n): all-gather moves
(n-1)/n of the gathered result, reduce-scatter (n-1)/n of its input, all-reduce twice that,
all-to-all (n-1)/n of its buffer, a collective-permute the whole buffer. A group spread over k
dimensions of the torus drives k bidirectional rings (2 ports each); over DCN, the chip's share
of its host's network. Across slices, a TPU program sends and receives through the megascale
runtime (host-transfer `recv`s named after the collective they implement); each counts as that
collective among the slices, over DCN. Async collectives (`*-start` / `*-done` pairs, marked
`async_collective_name`, or configured as an async collective fusion, which libtpu's
`--xla_tpu_enable_async_collective_fusion*` flags make: one op shown up to three times under
one channel id, counted once) may overlap compute; synchronous ones (and DCN transfers, to be
safe) add to the step.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# libtpu flags for dense FSDP plans on 64+ chips (from MaxText's TPU recipes): without them
# libtpu compiles each FSDP weight gather as a synchronous all-reduce of a zero-filled buffer;
# with them, as async all-gathers under the layers' compute (the 70B plan's roofline MFU 74% ->
# 89%). `posttrain compile` tries them on every program and compiles without them where the
# compiler refuses (this libtpu fails a RET_CHECK on the Kimi K2 MoE plan); so does a run's train
# step on TPU unless LIBTPU_INIT_ARGS is set. docs/compile.md has the measurements.
TPU_FLAGS = (
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true "
    "--xla_tpu_prefer_async_allgather_to_allreduce=true"
)
# The same flags as per-compile options (`compiled = lowered.compile(compiler_options=...)`),
# which `posttrain compile` and a run on TPU try first for every program.
TPU_OPTIONS = {f.split("=")[0].lstrip("-"): f.split("=")[1] for f in TPU_FLAGS.split()}


def compile_choosing_flags(compile, options: dict | None = None, *,
                           label: str = "async collectives",
                           what: str = "the async collective set"):  # fmt: skip
    """`(executable, which flags)`: `compile(options)` (default `TPU_OPTIONS`; `label` then),
    or `compile(None)` where the compiler refuses the program with them (this libtpu fails a
    RET_CHECK on the Kimi K2 plan with the async collective set), saying why. A program over
    memory is over memory either way: that error is raised."""
    import jax

    try:
        return compile(TPU_OPTIONS if options is None else options), label
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e):
            raise
        why = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:160]
        return compile(None), f"default ({what} failed: {why})"


KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5,
          "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\((.*)$"
)
_DCN_RECV = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\srecv\(.*xla_megascale_runtime.*"
    r'_xla_host_transfer_rendezvous="([a-z\-]+?)(?:-start)?\.'
)
_ASYNC_FUSION = '"async_collective_fusion_config"'
_CALLS = re.compile(r"\b(calls|body|condition|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the program (per device)."""

    kind: str  # one of KINDS
    nbytes: float  # its result's bytes (reduce-scatter: its input's) on one device
    group: int  # devices in each replica group
    count: int  # times it runs per step
    dcn: bool  # its groups span slices
    dims: int  # torus dimensions a group spreads over (ICI)
    overlappable: bool  # async (start/done): may run under compute

    @property
    def moved(self) -> float:
        """Bytes each device sends per run (ring algorithms)."""
        n = self.group
        if n <= 1:
            return 0.0
        share = (n - 1) / n
        return self.nbytes * {"all-reduce": 2 * share, "collective-permute": 1.0}.get(
            self.kind, share
        )

    def seconds(self, ici_port: float, dcn_chip: float) -> float:
        """Time of all its runs: over DCN at the chip's share of it, else over `dims` rings of
        bidirectional ports (`ici_port` bytes/s each way and back)."""
        bandwidth = dcn_chip if self.dcn else ici_port * max(self.dims, 1)
        return self.count * self.moved / bandwidth


def _shape_bytes(text: str) -> list[float]:
    """Bytes of every array shape in an HLO type (`(f32[64]{0}, bf16[8,2]{1,0})`)."""
    out = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _BYTES:
            out.append(_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
    return out


def _groups(attrs: str, devices: int) -> np.ndarray:
    """Replica groups as a [groups, size] array of device ids, from the three spellings XLA
    prints: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, and `mesh['a'=4,'b'=2] {'a'}`."""
    found = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if found:
        shape = [int(x) for x in found.group(1).split(",")]
        dims = [int(x) for x in found.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if found.group(3):
            ids = ids.transpose([int(x) for x in found.group(3).split(",")])
        return ids.reshape(shape[0], -1)
    found = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if found:
        axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
        names = [a for a, _ in axes]
        chosen = [names.index(a) for a in re.findall(r"'(\w+)'", found.group(2))]
        ids = np.arange(math.prod(int(s) for _, s in axes)).reshape([int(s) for _, s in axes])
        rest = [i for i in range(len(axes)) if i not in chosen]
        size = math.prod(ids.shape[i] for i in chosen)
        return ids.transpose(rest + chosen).reshape(-1, size)
    found = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", attrs)
    if found:
        listed = re.findall(r"\{([\d, ]*)\}", found.group(1))
        groups = [[int(x) for x in g.split(",") if x] for g in listed]
        if groups and len({len(g) for g in groups}) == 1:
            return np.array(groups)
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    listed = re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)) if pairs else []
    if listed:  # collective-permute: each pair is a "group" of two
        return np.array([[int(a), int(b)] for a, b in listed])
    return np.arange(devices)[None]  # no groups (or an empty list): every device


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and line[:1] in ("%", "E"):
            name = header.group(2)
            comps[name] = []
            entry = name if header.group(1) else entry
        elif line.rstrip() == "}":  # (an instruction's JSON config may span lines: "}}, ...")
            name = None
        elif name is not None:
            comps[name].append(line)
    comps["__entry__"] = [entry] if entry else []
    return comps


def _trip_count(lines: list[str]) -> int:
    """A while loop's trip count from its condition (`i < N`: the largest integer constant)."""
    constant = r"s(?:32|64)\[\](?:\{[^}]*\})?\s+constant\((\d+)\)"  # s32[]{:T(128)} constant(8)
    values = [int(v) for v in re.findall(constant, "\n".join(lines))]
    return max(values, default=1)


def _runs(comps: dict[str, list[str]]) -> dict[str, int]:
    """How many times each computation runs per program execution."""
    runs: dict[str, int] = {}
    (entry,) = comps["__entry__"] or [None]
    stack = [(entry, 1)] if entry else []
    while stack:
        name, times = stack.pop()
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, ()):
            called = dict(_CALLS.findall(line))
            trips = _trip_count(comps.get(called["condition"], [])) if "body" in called else 1
            for key, callee in called.items():
                if callee in comps and key != "to_apply":
                    stack.append((callee, times * (trips if key == "body" else 1)))
            for branches in _BRANCHES.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    if callee in comps:
                        stack.append((callee, times))  # an upper bound: every branch counted
    return runs


def collectives(hlo: str, *, devices: int, slice_of=None, torus=()) -> list[Collective]:
    """The collectives of an optimized HLO module (`compiled.as_text()`).

    Args:
      hlo: the program's text.
      devices: devices the program runs on.
      slice_of: device id -> slice index (None: one slice).
      torus: the slice's torus shape, e.g. (4, 4, 8): how many dimensions a group spreads over.
    """
    comps = _computations(hlo)
    runs = _runs(comps)
    dims_sorted = sorted(torus, reverse=True)
    found = []
    channels: dict[str, int] = {}  # channel id -> its index in `found`
    for name, lines in comps.items():
        if name not in runs:
            continue
        for line in lines:
            recv = _DCN_RECV.match(line) if slice_of is not None else None
            if recv:  # one slice's share of a collective among the slices
                slices = len({slice_of(i) for i in range(devices)})
                nbytes = max(_shape_bytes(recv.group(1)), default=0.0)
                found.append(Collective(recv.group(2), nbytes, slices, runs[name], True, 1, False))
                continue
            op = _OP.match(line)
            if not op:
                continue
            result, kind, start, rest = op.groups()
            # TPU's async collective fusions carry their collective in a config of its own
            start = start or any(m in rest for m in ("async_collective_name=", _ASYNC_FUSION))
            channel = re.search(r"channel_id=(\d+)", rest)
            if kind == "collective-permute":
                channel = None  # XLA gives every permute channel 1: each start is its own
            if channel and channel.group(1) in channels:
                # One collective, several copies: an async collective fusion's start, its done
                # and the compute fused with it each show the op under the same channel.
                i = channels[channel.group(1)]
                async_ = found[i].overlappable or bool(start)
                found[i] = dataclasses.replace(found[i], overlappable=async_)
                continue
            sizes = _shape_bytes(result)
            if not sizes:
                continue
            groups = _groups(rest, devices)
            n = groups.shape[1]
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # TPU's fused all-reduce + slice: a reduce-scatter
                nbytes = sum(sizes)
            elif kind == "reduce-scatter":
                nbytes = n * sum(sizes)  # the result is 1/n of the input
            elif start and kind in ("all-gather", "collective-permute"):
                nbytes = max(sizes)  # (operands, results, context): the gathered buffer
            elif start:
                nbytes = sum(sizes) / 2  # (operands, results)
            else:
                nbytes = sum(sizes)
            dcn = slice_of is not None and any(
                len({slice_of(int(d)) for d in g}) > 1 for g in groups
            )
            spread = next((k for k in range(1, len(dims_sorted) + 1)
                           if math.prod(dims_sorted[:k]) >= n), len(dims_sorted))  # fmt: skip
            if channel:
                channels[channel.group(1)] = len(found)
            found.append(Collective(kind, float(nbytes), n, runs[name], dcn, spread, bool(start)))
    return found


_SUMMARY_KEYS = ("ops", "runs", "bytes", "seconds", "dcn_seconds", "overlappable_seconds")


def summary(found: list[Collective], ici_port: float, dcn_chip: float) -> dict[str, dict]:
    """{kind: {"ops", "runs", "bytes" moved per device per step, "seconds"}} plus "total"."""
    out: dict[str, dict] = {}
    for c in found:
        row = out.setdefault(c.kind, dict.fromkeys(_SUMMARY_KEYS, 0.0))
        seconds = c.seconds(ici_port, dcn_chip)
        row["ops"] += 1
        row["runs"] += c.count
        row["bytes"] += c.count * c.moved
        row["seconds"] += seconds
        row["dcn_seconds"] += seconds if c.dcn else 0.0
        row["overlappable_seconds"] += seconds if c.overlappable else 0.0
    total = {k: sum(r[k] for r in out.values()) for k in _SUMMARY_KEYS}
    return {**out, "total": total}
