"""Starting the subprocesses tests run: one process or several joined over gloo on this host,
each with its own count of fake CPU devices; multi-process runs check every step that the
processes still agree (`POSTTRAIN_CHECK_PROCESSES`)."""

import os
import socket
import subprocess
import sys

# How tests compile XLA:CPU programs they mostly compile rather than run (tests/README.md): LLVM
# without optimisation (-O0), and fusions through XLA:CPU's older elemental emitters instead of
# its MLIR fusion emitters, which take longer to compile (tests/models + tests/losses: 221 ->
# 149 s on 2 cores).
# `make test-slow` sets POSTTRAIN_TEST_COMPILE=optimized: its long trainings run faster
# optimised, and with FAST_COMPILE the CAD demo's GRPO (8 fake devices) hung at step 3-4 in an
# all-reduce whose 8 device threads never all arrived (at a8a8221 and later; at XLA's default
# optimisation it finished), so FAST_COMPILE is "" there.
FAST_COMPILE = (
    ""
    if os.environ.get("POSTTRAIN_TEST_COMPILE") == "optimized"
    else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
# XLA:CPU aborts the process when a collective's fake devices do not all arrive within 40 s; on
# 2 busy cores a test's 8 device threads can be that late (seen: "Fatal Python error: Aborted"
# in a slow GRPO test while other work ran). A test is stopped by its own timeouts instead.
PATIENT_COLLECTIVES = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=900 "
    "--xla_cpu_collective_timeout_seconds=900"
)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A run's place among several processes: set by `launch` for its own runs, never inherited.
_PROCESSES = ("POSTTRAIN_COORDINATOR", "POSTTRAIN_NUM_PROCESSES", "POSTTRAIN_PROCESS_ID",
              "POSTTRAIN_CHECK_PROCESSES")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(
    argv: list[str],
    *,
    devices: int = 1,
    process_id: int | None = None,
    num_processes: int | None = None,
    port: int | None = None,
    env: dict[str, str] | None = None,
    stderr=subprocess.STDOUT,
    unoptimised: bool = True,
) -> subprocess.Popen:
    """`python argv...` in the repository with `devices` fake CPU devices; with
    `num_processes`, as process `process_id` of a run whose coordinator is localhost:`port`.
    Output is text on `stdout` (stderr merged unless given). `unoptimised`: compiled with
    FAST_COMPILE as the in-process tests are (tests/conftest.py; a short run spends most of its time
    compiling: the 2-process GRPO test 46 -> 30 s); False for a long run that mostly executes."""
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and k not in _PROCESSES}
    environ.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {PATIENT_COLLECTIVES}"
        + (f" {FAST_COMPILE}" if unoptimised else ""),
        JAX_PLATFORMS="cpu",
        PJRT_NPROC=str(max(8, 4 * devices)),  # (posttrain.parallel.size_cpu_thread_pool)
        PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
    )
    environ.update(env or {})
    environ = {k: v for k, v in environ.items() if v is not None}  # (env: None unsets one)
    if num_processes:
        environ.update(
            POSTTRAIN_COORDINATOR=f"localhost:{port}",
            POSTTRAIN_NUM_PROCESSES=str(num_processes),
            POSTTRAIN_PROCESS_ID=str(process_id),
            POSTTRAIN_CHECK_PROCESSES="1",
        )
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def launch_group(argv: list[str], *, processes: int, devices: int, env=None, stderr=None):
    """`processes` processes of one run, `devices` fake devices each."""
    port = free_port()
    return [
        launch(
            argv,
            devices=devices,
            process_id=i,
            num_processes=processes,
            port=port,
            env=env,
            stderr=subprocess.STDOUT if stderr is None else stderr,
        )
        for i in range(processes)
    ]


def finish(process: subprocess.Popen, timeout: float = 900) -> str:
    """The output of a process that must exit 0 (else the test fails with its tail)."""
    import pytest

    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"a subprocess ran past {timeout} s:\n{(out or '')[-4000:]}{err or ''}")
    if process.returncode != 0:
        pytest.fail(f"a subprocess failed ({process.returncode}):\n{(out or '')[-4000:]}"
                    f"{(err or '')[-4000:]}")  # fmt: skip
    return out
