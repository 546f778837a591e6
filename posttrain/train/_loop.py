"""The one training loop every method uses: data -> sharded step -> metrics, eval, checkpoints.

The host never waits on the device mid-run: metrics of step t are fetched after step t+1 is
dispatched. SIGTERM (TPU preemption) saves a checkpoint at the current step and exits cleanly.

`data` yields this process's host batches and has `get_state`/`set_state` (its position is saved
with every checkpoint). A source that makes its batches with the model being trained (RL:
prompts -> rollouts -> rewards -> advantages) also has
  `observe(step, state, metrics)`: called with the starting state (`metrics` None) and after
    each step is dispatched with the new state and the step's device metrics (not fetched);
  `batch_metrics() -> dict`: host metrics of the batch last drawn (rewards, timings...),
    logged with that step's device metrics;
  `watch(step, metrics) -> dict` (optional): more metrics from a step's fetched ones (RL's
    stability alerts), logged with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.parallel import Watchdog, agree, checks_enabled, crossing, shard_batch, tracing
from posttrain.train._checkpoint import Checkpointer
from posttrain.train._metrics import MetricsWriter, peak_flops_per_device
from posttrain.train._sinks import check_log_to, tracker_params

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = 1000  # total optimizer steps of the run
    micro_batches: int = 1  # gradient accumulation: micro-batches per step, inside the step
    log_every: int = 10  # write train metrics every N steps
    eval_every: int = 0  # held-out eval every N steps (0: only at the end)
    eval_batches: int = 0  # eval batches per evaluation (0: the whole eval set)
    max_bad_steps: int = 5  # consecutive non-finite steps before the run stops (with a save)
    seed: int = 0  # PRNG seed of the train state (init, dropout, sampling)
    progress: bool = True  # show a progress bar
    # Multi-process runs: a step (or eval, or save) taking longer than this means a peer died
    # or hung; the process stops with an error instead of waiting forever (0: off). The
    # first step, which compiles, gets max(this, 30 minutes).
    step_timeout_s: float = 600.0
    # "N:M": a jax.profiler trace of steps N to M (inclusive; RL: generation, rewards and the
    # update) into <workdir>/profile, for TensorBoard's profile plugin or Perfetto. "" = off.
    profile_steps: str = ""
    # Where metrics go: "jsonl" (always), "tensorboard", "wandb", "mlflow" (each tracker's
    # package installed by its extra: posttrain[wandb], posttrain[mlflow]).
    log_to: tuple[str, ...] = ("jsonl", "tensorboard")
    project: str = ""  # W&B project and MLflow experiment ("": "posttrain")
    run_name: str = ""  # the trackers' run name ("": the workdir's name)
    mlflow_uri: str = ""  # MLflow tracking URI ("": MLFLOW_TRACKING_URI, else <workdir>/mlruns)
    # OpenTelemetry spans of each step (posttrain[trace]): generation, environment steps and
    # tool calls, reward calls, the update; to an OTLP collector at trace_endpoint (or the
    # OTEL_EXPORTER_OTLP_* environment), else <workdir>/traces/process<i>.jsonl.
    trace: bool = False
    trace_endpoint: str = ""

    def __post_init__(self):
        if self.steps <= 0 or self.micro_batches <= 0 or self.log_every <= 0:
            raise ValueError("train.steps, train.micro_batches and train.log_every must be > 0")
        if self.eval_every < 0 or self.eval_batches < 0 or self.max_bad_steps < 1:
            raise ValueError(
                "train.eval_every and train.eval_batches must be >= 0, train.max_bad_steps >= 1"
            )
        if self.step_timeout_s < 0:
            raise ValueError("train.step_timeout_s must be >= 0 (0 turns the watchdog off)")
        self.profile_range()  # checks the spelling
        check_log_to(self.log_to)

    def profile_range(self) -> tuple[int, int] | None:
        """(first, last) step of `profile_steps`, or None when profiling is off."""
        if not self.profile_steps:
            return None
        found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", self.profile_steps)
        if not found or not 1 <= int(found.group(1)) <= int(found.group(2)):
            raise ValueError(
                f"train.profile_steps={self.profile_steps!r}: write FIRST:LAST, two step numbers "
                "with 1 <= FIRST <= LAST, e.g. 5:7 (steps 5, 6 and 7)"
            )
        return int(found.group(1)), int(found.group(2))


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps; a checkpoint was saved before raising."""


class _Preemption:
    """Turns SIGTERM into a flag the loop polls, restoring the old handler afterwards."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): no signal handling
            self._old = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class _Profiler:
    """Traces `loop.profile_steps` with `jax.profiler` into <workdir>/profile: the host's
    Python and every device program of those steps (RL: the rollout source's generation and
    rewards, drawn in `next(data)`, and the update). A remote workdir gets the trace uploaded
    when it stops. View: `tensorboard --logdir <workdir>/profile` (Profile tab) or the
    `*.trace.json.gz` in https://ui.perfetto.dev."""

    def __init__(self, loop: LoopConfig, workdir: str):
        self.range, self.workdir = loop.profile_range(), workdir
        self.folder: str | None = None

    def start(self, step: int) -> None:
        if self.range is None or step != self.range[0]:
            return
        out = paths.join(self.workdir, "profile")
        self.folder = tempfile.mkdtemp(prefix="posttrain-profile-") if paths.is_remote(out) else out
        jax.profiler.start_trace(self.folder, create_perfetto_trace=True)
        log.info("profiling steps %d to %d into %s", *self.range, out)

    def annotate(self, name: str, step: int):
        """A named span on the trace's host timeline (nothing when not tracing)."""
        if self.folder is None:
            return contextlib.nullcontext()
        return jax.profiler.TraceAnnotation(f"{name} {step}")

    def stop(self, step: int, metrics=None, *, force: bool = False) -> None:
        if self.folder is None or not (force or step == self.range[1]):
            return
        jax.block_until_ready(metrics)  # the last step's device work is in the trace
        jax.profiler.stop_trace()
        out = paths.join(self.workdir, "profile")
        if paths.is_remote(out):
            paths.upload(self.folder, out)
        self.folder = None


def _host_metrics(metrics) -> dict[str, float]:
    """Device metrics as floats. On a good step a NaN metric is a mean over nothing (a group
    such as "accuracy/math" absent from the batch, every completion masked): left out; a bad
    step's are all kept, to show what went wrong."""
    host = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if host.get("bad_step"):
        return host
    return {k: v for k, v in host.items() if not np.isnan(v)}


def _tokens(batch: dict) -> float:
    """Real tokens in a host batch (every `*segment_ids` array: SFT rows, chosen + rejected)."""
    return float(sum(np.sum(v > 0) for k, v in batch.items() if k.endswith("segment_ids")))


def _shapes(batch: dict) -> str:
    """A global batch's shapes, for the check that processes step alike."""
    return ", ".join(f"{k}{list(v.shape)}" for k, v in sorted(batch.items()))


def train_loop(
    *,
    state,
    step_fn: Callable,
    data: Iterator,
    mesh,
    workdir: str,
    loop: LoopConfig,
    checkpointer: Checkpointer,
    evaluate: Callable[[object], dict] | None = None,
    checkpoint_json: dict | None = None,
    flops_per_token: float | None = None,
    on_metrics: Callable[[int, dict], None] | None = None,
    updates_per_step: int = 1,
    eval_first: bool = False,
) -> tuple[object, dict]:
    """Runs `step_fn` from `state.step` to `loop.steps`.

    Args:
      state: the train state (fresh or restored), already sharded.
      step_fn: jitted `(state, batch) -> (state, metrics)`.
      data: this process's numpy batches, with `get_state()` for checkpoints (and `observe`,
        `batch_metrics` when it samples with the trained model; see the module docstring).
      mesh: the device mesh batches are placed on.
      workdir: where metrics, TensorBoard events and checkpoints go.
      loop: steps, logging and eval cadence, divergence limit.
      checkpointer: saves at `checkpointer.every`, at the end, on SIGTERM and on divergence.
      evaluate: `state -> {"eval_loss": ..., ...}`; its loss ranks checkpoints for keep-best.
      checkpoint_json: JSON items stored with every checkpoint (config, manifest).
      flops_per_token: training FLOPs per token, for the MFU estimate.
      on_metrics: called with `(step, metrics)` whenever train metrics reach the host.
      updates_per_step: optimizer updates in one `step_fn` call (`state.step` counts updates).
      eval_first: a fresh run also evaluates the starting state (the curve's step-0 point).

    Returns:
      The final state and a summary (last metrics, eval metrics, why the loop stopped).
    """
    start = int(jax.device_get(state.step)) // updates_per_step
    observe = getattr(data, "observe", None)
    batch_metrics = getattr(data, "batch_metrics", None)
    watch = getattr(data, "watch", None)
    writer = MetricsWriter(
        workdir, resume_step=start, log_to=loop.log_to, project=loop.project,
        run_name=loop.run_name, mlflow_uri=loop.mlflow_uri,
        params=tracker_params(checkpoint_json),
    )  # fmt: skip
    peak = peak_flops_per_device()
    summary: dict = {"start_step": start, "stopped": "completed"}
    saved_step = start if checkpointer.latest_step() == start else None

    def save(step, state, metrics=None, force=False):
        nonlocal saved_step, pending
        checkpointer.wait()  # the previous save (Orbax waits for it anyway): its error first
        if pending is not None and pending[0] == step:
            # The step's metrics are logged before its checkpoint, so that a run resumed from
            # it (after a kill) has every line up to it; they reach a gs:// log here too.
            flush(pending)
            pending = None
        writer.flush()
        data_state = data.get_state() if hasattr(data, "get_state") else None
        checkpointer.save(
            step, state, data_state=data_state, extra=checkpoint_json, metrics=metrics, force=force
        )
        saved_step = step

    def run_eval(step, state):
        if evaluate is None:
            return None
        with tracing.step_span(step, kind="eval"):
            metrics = evaluate(state)
        writer.write(step, metrics, split="eval")
        summary["eval"] = metrics
        return metrics

    bar = tqdm(
        total=loop.steps,
        initial=start,
        disable=not loop.progress or jax.process_index(),
        desc="train",
        dynamic_ncols=True,
    )
    pending = None  # (step, device metrics, tokens, seconds) of the previous step
    last_time = time.perf_counter()
    watchdog = Watchdog(loop.step_timeout_s if jax.process_count() > 1 else 0.0)
    check_processes = checks_enabled()
    profiler = _Profiler(loop, workdir)
    with _Preemption() as preemption, watchdog, contextlib.ExitStack() as stack:
        stack.callback(lambda: profiler.stop(0, force=True))  # a run that stops early
        if loop.trace:
            where = tracing.configure(workdir, endpoint=loop.trace_endpoint,
                                      process=jax.process_index())  # fmt: skip
            stack.callback(tracing.shutdown)
            log.info("tracing each step's spans to %s", where)

        def flush(pending):
            step, metrics, tokens, seconds, source_metrics = pending
            host = {**_host_metrics(metrics), **source_metrics}
            host["step_s"] = seconds  # host time between the step's dispatch and the previous
            host["tokens_per_second"] = tokens / max(seconds, 1e-9)
            if flops_per_token and peak:
                host["mfu"] = (
                    flops_per_token * host["tokens_per_second"] / (peak * jax.device_count())
                )
            if watch is not None:
                host.update(watch(step, host))
            summary["train"] = host
            if step % loop.log_every == 0 or step == loop.steps:
                writer.write(step, host)
            if on_metrics is not None:
                on_metrics(step, host)
            postfix = {"loss": f"{host['loss']:.4f}", "tok/s": f"{host['tokens_per_second']:.0f}"}
            if "mfu" in host:
                postfix["mfu"] = f"{100 * host['mfu']:.1f}%"
            bar.set_postfix(postfix, refresh=False)
            return host

        if eval_first and start == 0:
            run_eval(0, state)
        if observe is not None:
            observe(start, state, None)
        for step in range(start + 1, loop.steps + 1):
            profiler.start(step)
            with tracing.step_span(step):
                with profiler.annotate("batch", step), tracing.span("batch"):
                    host_batch = next(data)  # RL: generation and rewards
                source_metrics = batch_metrics() if batch_metrics is not None else {}
                tokens = _tokens(host_batch) * jax.process_count()
                batch = shard_batch(host_batch, mesh)
                if "batch_shapes" not in summary:  # what the step ran on (checked by compile's)
                    summary["batch_shapes"] = jax.tree.map(
                        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch
                    )
                if jax.process_count() > 1:  # (the step is a program spanning the processes)
                    crossing(f"train step {_shapes(batch)}")
                    if check_processes:
                        agree("loop", f"step {step}")
                with profiler.annotate("train", step), tracing.span("update"):
                    state, metrics = step_fn(state, batch)
            profiler.stop(step, metrics)
            if observe is not None:
                observe(step, state, metrics)
            if pending is not None:
                host = flush(pending)
                # (bad_steps counts updates: a stop needs every update of as many steps bad)
                if host["bad_steps"] >= loop.max_bad_steps * updates_per_step:
                    save(step, state, force=True)
                    checkpointer.wait()
                    summary["stopped"] = "diverged"
                    break
            now = time.perf_counter()
            pending = (step, metrics, tokens, now - last_time, source_metrics)
            last_time = now
            bar.update(1)
            watchdog.beat()
            checkpointer.check()  # a save that failed in the background stops the run here

            eval_metrics = None
            if loop.eval_every and step % loop.eval_every == 0 and step != loop.steps:
                eval_metrics = run_eval(step, state)
            if step % checkpointer.every == 0 and step != loop.steps:
                save(step, state, metrics=eval_metrics)
            watchdog.beat()  # evaluation and saves wait on every process too
            if preemption.requested or checkpointer.manager.reached_preemption(step):
                if saved_step != step:
                    save(step, state, force=True)
                summary["stopped"] = "preempted"
                break

        if pending is not None and summary["stopped"] != "diverged":
            flush(pending)
            pending = None
        final_step = int(jax.device_get(state.step)) // updates_per_step
        if summary["stopped"] == "completed":
            eval_metrics = run_eval(final_step, state)
            if saved_step != final_step:
                save(final_step, state, metrics=eval_metrics, force=True)
        checkpointer.wait()
    bar.close()
    writer.close()
    summary["final_step"] = final_step
    if summary["stopped"] == "diverged":
        raise TrainingDiverged(
            f"{loop.max_bad_steps} consecutive steps had a non-finite loss or gradient (last at "
            f"step {final_step}); the updates were skipped and a checkpoint was saved at step "
            f"{final_step}. Lower optimizer.learning_rate, check the data, or raise "
            f"train.max_bad_steps."
        )
    return state, summary
