"""The TPU generations this tool knows: gcloud's accelerator-type name for each, the sizes it
offers as single-slice types, and the default TPU software (runtime) version.

Sources (Cloud TPU documentation):
  runtimes  https://cloud.google.com/tpu/docs/runtimes ("TPU software versions", PyTorch and JAX
            table): v6e v2-alpha-tpuv6e, v5p v2-alpha-tpuv5, v5e v2-alpha-tpuv5-lite,
            v4 and older tpu-ubuntu2204-base.
  v6e       https://cloud.google.com/tpu/docs/v6e: 1x1 ... 16x16 slices, types v6e-1 ... v6e-256
            (chips).
  v5e       https://cloud.google.com/tpu/docs/v5e: 1x1 ... 16x16 slices, 1 to 256 chips; gcloud
            and the TPU API call it v5litepod (enum V5LITE_POD), e.g. v5litepod-16.
  v5p       https://cloud.google.com/tpu/docs/supported-tpu-configurations: v5p-8 ... v5p-12288,
            the size counting TensorCores (2 per chip; v5p-8 is 4 chips).
  v4        https://cloud.google.com/tpu/docs/v4: 2 TensorCores per chip, a 4096-chip pod.
Shapes outside these tables (gcloud's --topology/--type) are not wrapped here: call gcloud.
"""

from __future__ import annotations

from typing import NamedTuple


class Generation(NamedTuple):
    gcloud_name: str  # the prefix gcloud's --accelerator-type uses
    unit: str  # what the size after the dash counts
    sizes: tuple  # the sizes accepted (powers of two, plus v5p's full 16x16x24 slice)
    runtime: str  # default --version (tpu-vm create) / --runtime-version (queued-resources)


def _powers_of_two(lo: int, hi: int) -> tuple:
    return tuple(n for n in (2**i for i in range(32)) if lo <= n <= hi)


_SMALL_POD = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e and v6e: 1x1, 2x2, 2x4, ..., 16x16 chips

GENERATIONS = {
    "v4": Generation(
        "v4", "TensorCores (2 per chip)", _powers_of_two(8, 8192), "tpu-ubuntu2204-base"
    ),
    "v5e": Generation("v5litepod", "chips", _SMALL_POD, "v2-alpha-tpuv5-lite"),
    "v5p": Generation(
        "v5p", "TensorCores (2 per chip)", _powers_of_two(8, 8192) + (12288,), "v2-alpha-tpuv5"
    ),
    "v6e": Generation("v6e", "chips", _SMALL_POD, "v2-alpha-tpuv6e"),
}
_BY_GCLOUD_NAME = {g.gcloud_name: key for key, g in GENERATIONS.items()}

FORMS = (
    "accelerator types are <generation>-<size> with generation v4, v5e, v5p or v6e, e.g. "
    "v5p-128, v6e-16, v4-32; gcloud names v5e 'v5litepod' (v5litepod-16), and v5e-16 is accepted "
    "as an alias for it"
)


class Accelerator(NamedTuple):
    generation: str  # key of GENERATIONS: v4, v5e, v5p, v6e
    gcloud_type: str  # what gcloud's --accelerator-type gets, e.g. v5litepod-16
    size: int

    @property
    def runtime(self) -> str:
        return GENERATIONS[self.generation].runtime


def parse(text: str) -> Accelerator:
    """Parses and checks an accelerator type; raises ValueError with the accepted forms."""
    prefix, _, size_text = text.strip().lower().rpartition("-")
    key = prefix if prefix in GENERATIONS else _BY_GCLOUD_NAME.get(prefix)
    if key is None or not size_text.isdigit():
        raise ValueError(f"unknown accelerator type {text!r}: {FORMS}")
    generation, size = GENERATIONS[key], int(size_text)
    if size not in generation.sizes:
        raise ValueError(
            f"{text!r} is not a {key} size: {key} sizes count {generation.unit} and are one of "
            f"{', '.join(str(s) for s in generation.sizes)} ({FORMS})"
        )
    return Accelerator(key, f"{generation.gcloud_name}-{size}", size)
