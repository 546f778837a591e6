"""Metrics to JSONL, TensorBoard and the trackers `train.log_to` names; throughput and MFU."""

from __future__ import annotations

import json
import tempfile
import time

import jax

from posttrain import paths
from posttrain.errors import UserError
from posttrain.train._sinks import check_log_to, open_sinks

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
    """Appends `{"step", "split", ...}` lines to `<workdir>/metrics.jsonl`, and writes the same
    values as TensorBoard events and to W&B and MLflow where `log_to` names them (`_sinks`).

    Only process 0 writes. On resume, lines past the restored step (written after the checkpoint
    by a run that then died) are dropped so the log reads as one uninterrupted run.

    An object store cannot append: under a gs:// workdir the lines are kept and the object is
    rewritten whole at most every `upload_secs`, at each `flush()` (the loop calls it with every
    checkpoint, so a resumed run finds every line up to its step) and at `close()`. TensorBoard
    events are written to a local folder and uploaded at the same times (tensorboardX's own gs://
    writer re-uploads from `__del__`, after a run has ended).
    """

    def __init__(
        self,
        workdir: str,
        *,
        resume_step: int | None = None,
        upload_secs=30.0,
        log_to=("jsonl", "tensorboard"),
        project: str = "",
        run_name: str = "",
        mlflow_uri: str = "",
        params: dict | None = None,
    ):
        check_log_to(log_to)
        self.enabled = jax.process_index() == 0
        self.path = paths.path(workdir) / "metrics.jsonl"
        self._remote = paths.is_remote(workdir)
        self._upload_secs, self._uploaded_at = upload_secs, time.monotonic()
        self._lines: list[str] = []  # gs:// only: the whole log, rewritten by flush()
        self._tb = self._tb_local = None
        self._tb_dir = paths.join(workdir, "tensorboard")
        self._sinks = []
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if resume_step is not None and record.get("step", 0) <= resume_step:
                    keep.append(line + "\n")
            self._lines = keep
            paths.write_text(self.path, "".join(keep))
        self._sinks = open_sinks(workdir, log_to, project=project, run_name=run_name,
                                 mlflow_uri=mlflow_uri, params=params or {})  # fmt: skip
        if "tensorboard" in log_to:
            self._open_tensorboard()

    def _open_tensorboard(self) -> None:
        from tensorboardX import SummaryWriter

        if self._remote:
            self._tb_local = tempfile.TemporaryDirectory(prefix="posttrain-tensorboard-")
        # A queue that never fills: tensorboardX's writer thread dies on a write error (a full
        # disk), and a full queue would then block the loop forever; `_check_tensorboard` stops
        # the run instead.
        self._tb = SummaryWriter(
            self._tb_local.name if self._remote else self._tb_dir, max_queue=1 << 20
        )
        # Its thread's write errors are kept for the next `write` to report in one line (a
        # thread that died would print a traceback, and race the checkpoint's own error).
        self._tb_error: OSError | None = None
        event_writer = self._tb._get_file_writer().event_writer
        worker = getattr(event_writer, "_worker", None)
        if worker is not None:
            worker._record_writer = _Kept(worker._record_writer, self._keep_tb_error)

    def write(self, step: int, metrics: dict, split: str = "train") -> None:
        if not self.enabled:
            return
        values = {k: float(v) for k, v in metrics.items()}
        line = json.dumps({"step": int(step), "split": split, **values}) + "\n"
        if self._remote:
            self._lines.append(line)
            if time.monotonic() - self._uploaded_at >= self._upload_secs:
                self.flush()
        else:
            with self.path.open("a") as f:
                f.write(line)
        if self._tb is not None:
            self._check_tensorboard()
            for name, value in values.items():
                self._tb.add_scalar(f"{split}/{name}", value, int(step))
        for sink in self._sinks:
            sink.write(int(step), split, values)

    def _keep_tb_error(self, error: OSError) -> None:
        self._tb_error = self._tb_error or error

    def _check_tensorboard(self) -> None:
        """Raises if tensorboardX's writer thread could not write, or has died."""
        if self._tb_error is not None:
            raise UserError(
                f"TensorBoard events could not be written to {self._tb_dir}: "
                f"{self._tb_error.strerror or self._tb_error}; free space (or fix the "
                "destination) and rerun to resume from the last checkpoint"
            )
        writer = self._tb._get_file_writer().event_writer
        worker = getattr(writer, "_worker", None)
        if worker is not None and not worker.is_alive():
            raise UserError(
                f"TensorBoard events could not be written to {self._tb_dir} (the writer's error "
                "is above: a full or read-only disk?); free space and rerun to resume from the "
                "last checkpoint"
            )

    def flush(self) -> None:
        """Makes every line written so far readable at `self.path` (a no-op on local disk)."""
        if self.enabled and self._remote:
            paths.write_text(self.path, "".join(self._lines))
            if self._tb is not None:
                self._tb.flush()
                paths.upload(self._tb_local.name, self._tb_dir)
            self._uploaded_at = time.monotonic()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        self.flush()
        if self._tb_local is not None:
            self._tb_local.cleanup()


def read_metrics(workdir: str, split: str = "train") -> list[dict]:
    """The logged metrics of one split, in step order."""
    path = paths.path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("split") == split]


class _Kept:
    """An event file writer whose OSErrors (a full or read-only disk) go to `keep` instead of
    ending tensorboardX's writer thread; the events they lose are dropped."""

    def __init__(self, writer, keep):
        self._writer, self._keep = writer, keep

    def write_event(self, event) -> None:
        try:
            self._writer.write_event(event)
        except OSError as e:
            self._keep(e)

    def flush(self) -> None:
        try:
            self._writer.flush()
        except OSError as e:
            self._keep(e)

    def __getattr__(self, name):
        return getattr(self._writer, name)
