"""Metrics to JSONL and TensorBoard, throughput and MFU."""

from __future__ import annotations

import json
import os

import jax

# Dense bf16 peak FLOP/s per chip, from the vendors' datasheets.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5": 459e12,  # v5p
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def peak_flops_per_device() -> float | None:
    kind = jax.devices()[0].device_kind
    for name, flops in PEAK_FLOPS.items():
        if kind.startswith(name):
            return flops
    return None


class MetricsWriter:
    """Appends `{"step", "split", ...}` lines to `<workdir>/metrics.jsonl` and TensorBoard events.

    Only process 0 writes. On resume, lines past the restored step (written after the checkpoint
    by a run that then died) are dropped so the log reads as one uninterrupted run.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path):
            keep = []
            with open(self.path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a kill
                    if resume_step is not None and record.get("step", 0) <= resume_step:
                        keep.append(line if line.endswith("\n") else line + "\n")
            with open(self.path, "w") as f:
                f.writelines(keep)
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), flush_secs=10)

    def write(self, step: int, metrics: dict, split: str = "train") -> None:
        if not self.enabled:
            return
        values = {k: float(v) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "split": split, **values}) + "\n")
        for name, value in values.items():
            self._tb.add_scalar(f"{split}/{name}", value, int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str, split: str = "train") -> list[dict]:
    """The logged metrics of one split, in step order."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("split") == split]
