"""Multi-process runs: `jax.distributed` on TPU VMs, GPU clusters and CPU hosts, and a watchdog
so that a dead or stuck peer ends the run with a clear error instead of a silent hang.

Where the processes come from:
- Cloud TPU VMs (every worker runs the same command), Slurm (`srun`) and Open MPI (`mpirun`):
  JAX detects the coordinator, process count and id from the environment.
- Anything else (a GPU cluster without Slurm, several processes on one CPU host for tests):
  `--coordinator=host:port --num_processes=N --process_id=i`, or the environment variables
  `POSTTRAIN_COORDINATOR`, `POSTTRAIN_NUM_PROCESSES`, `POSTTRAIN_PROCESS_ID`.

On CPU the processes run their collectives over gloo. Every process feeds only its rows of the
global batch (`shard_batch`), process 0 alone writes metrics and logs, and every process takes
part in checkpoint saves (orbax coordinates them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import time

import jax

from posttrain.errors import EXIT_WATCHDOG, UserError

log = logging.getLogger(__name__)

ENV_PREFIX = "POSTTRAIN_"


class DistributedError(UserError, RuntimeError):
    """A multi-process setup that cannot start; the message says what to set."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (all fields optional)."""

    coordinator: str = ""  # "host:port" of process 0; "" = detect (TPU VM, Slurm, Open MPI)
    num_processes: int = 0  # 0 = detect
    process_id: int = -1  # -1 = detect
    initialization_timeout_s: int = 300  # waiting for every process to join
    # JAX's coordination service declares a process dead after this long without a heartbeat
    # and stops the others.
    heartbeat_timeout_s: int = 60

    @classmethod
    def from_env(cls, **flags) -> DistributedConfig:
        """Flags given here win over `POSTTRAIN_*` environment variables."""
        values = {}
        for field in ("coordinator", "num_processes", "process_id"):
            env = os.environ.get(ENV_PREFIX + field.upper())
            flag = flags.get(field)
            if flag not in (None, "", 0, -1):
                values[field] = flag
            elif env:
                values[field] = env if field == "coordinator" else _int(env, field)
        return cls(**values)

    @property
    def explicit(self) -> bool:
        return bool(self.coordinator or self.num_processes > 0 or self.process_id >= 0)


def _int(value: str, field: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{ENV_PREFIX}{field.upper()}={value!r} is not an integer") from None


def _cluster_detected() -> str | None:
    """The launcher that started this process as one of several, if any (JAX reads the
    coordinator, process count and id from it)."""
    env = os.environ
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1:  # inside srun
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "open mpi"
    if env.get("TPU_WORKER_HOSTNAMES") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "cloud tpu"  # GKE, multislice
    return "cloud tpu" if _on_tpu_vm_pod() else None


def _on_tpu_vm_pod() -> bool:
    """A Cloud TPU VM (a slice of one or more hosts): JAX's own check, which asks the GCE
    metadata server for the worker number only when TPU devices are present."""
    try:
        from jax._src.clusters.cloud_tpu_cluster import GceTpuCluster

        return bool(GceTpuCluster.is_env_present())
    except Exception:  # a JAX without this module, or no metadata server
        return False


# Threads per fake CPU device in XLA:CPU's pool (`size_cpu_thread_pool`).
CPU_THREADS_PER_DEVICE = 4


def size_cpu_thread_pool(environ=os.environ) -> None:
    """Gives XLA:CPU's thread pool room for every fake device's collectives (`PJRT_NPROC`,
    unless set), before JAX makes its CPU client.

    XLA:CPU runs the programs of all of a process's devices (`--xla_force_host_platform_
    device_count=N`) on one pool of max(cores, N) threads, and a collective holds its thread
    until every device has arrived. A program with two collectives ready at once (a layer
    scan's all-gather beside the all-reduce of a token count) can give two threads to some
    devices and none to another, which then never arrives: the run hangs (seen: GRPO on 1 x 8
    fake devices, 6 threads in one all-reduce and 2 in an all-gather, in 2 runs of 2).
    `CPU_THREADS_PER_DEVICE` threads per device leave room (the same run finished 2 of 2).
    """
    flags = environ.get("XLA_FLAGS", "")
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if found and "PJRT_NPROC" not in environ:
        devices = int(found.group(1))
        environ["PJRT_NPROC"] = str(max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * devices))


def initialize(config: DistributedConfig | None = None) -> bool:
    """Joins the multi-process run this process belongs to; a no-op for a single process.

    Must run before any JAX computation. Returns True when `jax.distributed` was initialised.

    Raises:
      DistributedError: a partial explicit setup (all three of coordinator, num_processes and
        process_id are needed), or a process id outside the range.
    """
    size_cpu_thread_pool()
    config = config or DistributedConfig.from_env()
    if _initialized():
        return True
    launcher = _cluster_detected()
    if not config.explicit and launcher is None:
        return False
    kwargs = dict(
        initialization_timeout=config.initialization_timeout_s,
        heartbeat_timeout_seconds=config.heartbeat_timeout_s,
    )
    if config.explicit:
        missing = [
            name
            for name, unset in (
                ("coordinator", not config.coordinator),
                ("num_processes", config.num_processes <= 0),
                ("process_id", config.process_id < 0),
            )
            if unset
        ]
        if missing:
            raise DistributedError(
                f"a multi-process run needs coordinator, num_processes and process_id; "
                f"{', '.join(missing)} missing (flags --coordinator/--num_processes/--process_id "
                f"or {ENV_PREFIX}COORDINATOR/NUM_PROCESSES/PROCESS_ID)"
            )
        if not 0 <= config.process_id < config.num_processes:
            raise DistributedError(
                f"process_id={config.process_id} is outside 0..{config.num_processes - 1}"
            )
        kwargs.update(
            coordinator_address=config.coordinator,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )
    if _cpu_only():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining a multi-process run (%s)", launcher or config.coordinator)
    jax.distributed.initialize(**kwargs)
    log.info("process %d of %d", jax.process_index(), jax.process_count())
    return True


def _initialized() -> bool:
    from jax._src import distributed

    return distributed.global_state.client is not None


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    try:  # without a hint, a host with no accelerator plugin installed
        import jax_plugins  # noqa: F401  (present with the cuda or tpu plugins)

        return False
    except ImportError:
        return True


class Watchdog:
    """Ends the process with a clear error when the run makes no progress for `timeout_s`.

    The train loop calls `beat()` after every step. A peer that died leaves the others blocked
    inside a collective, which can wait forever; JAX's heartbeat usually stops them first, and
    this is the backstop with a message that says what happened. The first step (compilation)
    gets `first_timeout_s`.
    """

    def __init__(self, timeout_s: float, first_timeout_s: float | None = None, *, exit_fn=None):
        self.timeout_s = timeout_s
        self.first_timeout_s = first_timeout_s or max(timeout_s, 1800.0)
        self._exit = exit_fn or os._exit
        self._last = time.monotonic()
        self._beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="posttrain-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()
        self._beats += 1

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            limit = self.timeout_s if self._beats else self.first_timeout_s
            idle = time.monotonic() - self._last
            if idle > limit:
                where = f"process {jax.process_index()} of {jax.process_count()}"
                print(
                    f"posttrain: no training progress for {idle:.0f} s ({where}, after step "
                    f"{self._beats}): another process probably died or hung. Stopping; resume "
                    "from the last checkpoint once every host is healthy (train.step_timeout_s "
                    "sets this limit).",
                    file=sys.stderr,
                    flush=True,
                )
                self._exit(EXIT_WATCHDOG)
                return
