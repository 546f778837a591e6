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
