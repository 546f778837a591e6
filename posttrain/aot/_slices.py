"""TPU slices for ahead-of-time plans: each generation's chip (HBM, peak FLOPs, bandwidths,
torus geometry), slice names as gcloud writes them, and libtpu's devices of a slice."""

from __future__ import annotations

import dataclasses
import math
import os
import re

from posttrain.config import ConfigError

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
