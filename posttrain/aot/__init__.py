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

from posttrain._flops import matmul_flops
from posttrain.aot._measure import Lowering, Program, bytes_per_device, measure, smallest_fit
from posttrain.aot._report import CompileReport, fastest_fit, remat_lines, suggestion
from posttrain.aot._slices import CHIPS, FIT_FRACTION, Chip, GiB, parse_topology, topology_devices

__all__ = [
    "CHIPS", "FIT_FRACTION", "GiB", "Chip", "CompileReport", "Lowering", "Program",
    "bytes_per_device", "fastest_fit", "matmul_flops", "measure", "parse_topology",
    "remat_lines", "smallest_fit", "suggestion", "topology_devices",
]  # fmt: skip
