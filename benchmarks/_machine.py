"""What a benchmark ran on, for its report (ratios move with the CPU: docs/benchmarks.md)."""

from __future__ import annotations

import os
import platform
import subprocess


def cpu_model() -> str:
    """lscpu's model name and this machine's core count, e.g. "AMD EPYC 7B13 (2 cores)"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        name = fields.get("Model name", "").strip()
    except (OSError, subprocess.CalledProcessError):
        name = ""
    return f"{name or platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")  # fmt: skip


def vector_extensions() -> str:
    """The vector instruction sets /proc/cpuinfo lists (what XLA:CPU and PyTorch can use)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return "unknown"
    return " ".join(flag for flag in VECTOR_FLAGS if flag in flags) or "none listed"
