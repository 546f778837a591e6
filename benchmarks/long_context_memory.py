"""Memory of one SFT step at long lengths, from XLA's compiled memory analysis on CPU.

    python benchmarks/long_context_memory.py            # --lengths=4096,8192,... --plain-max=8192
    python benchmarks/long_context_memory.py --sequence # per device over mesh.sequence = 1..8

The model is the `tiny_long` preset (2 layers, d=64, 32k vocabulary), one row per step, full
remat, configs/sft.py:tiny otherwise. Variants: `flash` attention with 1024-position logits
chunks (the preset), `flash` with the whole row's logits at once (`logits_chunk=0`), and the XLA
reference attention with whole logits (compiled up to `--plain-max` only: its unrolled query
blocks take minutes to compile at 8k). "temporaries" is what the compiled step allocates beside
its arguments and outputs; "logits" the size one `[1, L, V]` float32 logits tensor would have.
Nothing runs: only compiles. `--sequence`: the preset at `--length` (32k) on 1, 2, 4 and 8 fake
CPU devices with the rows' length sharded over them (ring attention), per device.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax  # noqa: E402

from posttrain import methods  # noqa: E402
from posttrain.config import load_config_file, override  # noqa: E402

GIB = 2**30


def step_memory(length: int, attention: str, logits_chunk: int, sequence: int = 1) -> dict:
    config = override(
        load_config_file("configs/sft.py:tiny"),
        {
            "model.preset": "tiny_long",
            "model.attention": attention,
            "model.logits_chunk": logits_chunk,
            "model.remat": "full",
            "data.max_len": length,
            "data.batch_size": 1,
            "mesh.ici": {"fsdp": 1, "sequence": sequence},
        },
    )
    start = time.perf_counter()
    low = methods.lowering(config, jax.devices()[:sequence])
    with jax.set_mesh(low.mesh):
        memory = low.jitted().lower(*low.arguments()).compile().memory_analysis()
    return {
        "temporaries": memory.temp_size_in_bytes,
        "arguments": memory.argument_size_in_bytes,
        "compile_seconds": time.perf_counter() - start,
    }


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))  # fmt: skip
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    parser.add_argument("--plain-max", type=int, default=8192)
    parser.add_argument("--sequence", action="store_true")
    parser.add_argument("--length", type=int, default=32_768)
    args = parser.parse_args()
    vocab = 32_768
    print(f"CPU: {_cpu()}; jax {jax.__version__}")
    if args.sequence:
        print(f"| mesh.sequence | temporaries per device at L = {args.length:,} | arguments |")
        print("|---|---|---|")
        for sequence in (1, 2, 4, 8):
            m = step_memory(args.length, "flash", 1024, sequence)
            print(f"| {sequence} | {m['temporaries'] / GIB:.3f} GiB | "
                  f"{m['arguments'] / GIB:.3f} GiB |", flush=True)  # fmt: skip
        return
    print("| L | logits [1, L, V] | flash + 1024-position chunks | flash, whole logits | "
          "xla, whole logits |")  # fmt: skip
    print("|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        cells = []
        for attention, chunk in (("flash", 1024), ("flash", 0), ("xla", 0)):
            if attention == "xla" and length > args.plain_max:
                cells.append("—")
                continue
            m = step_memory(length, attention, chunk)
            cells.append(f"{m['temporaries'] / GIB:.3f} GiB")
        logits = length * vocab * 4 / GIB
        print(f"| {length:,} | {logits:.2f} GiB | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
