"""Shared test setup: 8 fake CPU devices for sharding tests, quiet transformers."""

import os

from tests.launch import FAST_COMPILE, PATIENT_COLLECTIVES  # (imports no jax)

# Must be set before jax initialises its backends. The tiny test programs spend far longer in
# XLA:CPU's compiler than running: FAST_COMPILE (-O0, the older fusion emitters) makes the suite
# far faster and changes no result the tests check (tests/README.md).
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        FAST_COMPILE,
        PATIENT_COLLECTIVES,
    ]  # fmt: skip
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Room in XLA:CPU's thread pool for the 8 fake devices' collectives (PJRT_NPROC): without it a
# program with two collectives ready at once can hang (posttrain.parallel.size_cpu_thread_pool).
os.environ.setdefault("PJRT_NPROC", "32")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The TPU AOT test loads libtpu; let concurrent test processes each load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# No persistent compilation cache (JAX_COMPILATION_CACHE_DIR): with one, the slow test
# tests/rl/test_grpo.py::test_resume_continues_exactly deadlocked in XLA:CPU's collectives (8
# fake devices: "Termination timeout for all reduce RendezvousKey ... only 6 of them arrived")
# and passes without it (tests/README.md).

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.tolerance import checked_allclose  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
# Every assert_allclose of the suite goes through the tolerance check (tests/README.md).
np.testing.assert_allclose = checked_allclose


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test module: an xdist worker that keeps every
    program of the ~700 tests it runs holds tens of thousands of memory maps of JIT code, and
    XLA:CPU then crashed compiling (a segfault in backend_compile_and_load at ~80% of the
    suite, twice, 2026-12-05; vm.max_map_count is 65530)."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    if jax.default_backend() != "cpu" and len(devs) < 8:
        pytest.skip("needs 8 devices (runs on CPU with fake devices)")
    assert len(devs) == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"
    return devs


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
    """A GCS emulator on loopback (tests/gcs_emulator.py), reached only through
    STORAGE_EMULATOR_HOST as any emulator or GCS would be; yields its bucket's gs:// URL."""
    from tests import gcs_emulator

    process, host = gcs_emulator.start("posttrain-test")
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "POSTTRAIN_CACHE")}
    os.environ["STORAGE_EMULATOR_HOST"] = host
    os.environ["POSTTRAIN_CACHE"] = str(tmp_path_factory.mktemp("object_cache"))
    yield "gs://posttrain-test"
    process.kill()
    process.wait()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


TRAINED_STEPS = 200  # SFT steps of `trained_tiny`: its greedy answers end at EOS after 3-4 tokens


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """A trained start: configs/sft.py:tiny (the demo's recipe) cut to TRAINED_STEPS steps, so
    the model answers the demo's problems and stops at EOS after 2 to 4 tokens: rows of a batch
    end at different lengths, unlike a random model's. Built once per test session and shared
    by the xdist workers (file-locked). Returns the SFT workdir (`model.checkpoint=`)."""
    from filelock import FileLock

    from tests.launch import finish, launch

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    workdir = root / "trained_tiny"
    with FileLock(str(root / "trained_tiny.lock")):
        if not (workdir / "done").exists():
            argv = ["-m", "posttrain.cli", "train", "--config=configs/sft.py:tiny",
                    f"--workdir={workdir}", f"--config.train.steps={TRAINED_STEPS}",
                    "--config.train.eval_every=0", "--config.train.progress=False",
                    "--config.checkpoint.async_save=False"]  # fmt: skip
            finish(launch(argv, unoptimised=False), timeout=900)  # (200 steps: executing)
            (workdir / "done").touch()
    return str(workdir)


# How `make test` spreads the suite over its xdist workers (tests/README.md):
# - One worker runs all the tests of a module whose module fixtures train or load a model, so
#   each is built once, and of modules that share a file-locked session fixture, so the other
#   worker does not sit waiting on the lock (xdist's own `--dist loadgroup` cannot mark them under
#   pytest 9: it renames test ids through an attribute pytest 9 no longer reads).
ONE_WORKER = [
    ("tests/train/test_vlm_training.py",), ("tests/models/test_hf_stream.py",),
    ("tests/train/test_resume.py",), ("tests/lora/test_lora_sft.py",),
    ("tests/eval/test_harness.py",), ("tests/train/test_sft.py",),
    ("tests/models/test_nnx_example.py",), ("tests/train/test_reward_model.py",),
    ("tests/sampling/test_serve.py",), ("tests/lora/test_adapters.py",),
    ("tests/rl/test_router_replay.py",), ("tests/rl/test_loss.py",),
    ("tests/rl/test_multihost.py",),  # trained_tiny (test_grpo's user starts later)
    ("tests/envs/test_calculator.py", "tests/envs/test_endpoint.py"),  # calculator_sft
    ("tests/envs/test_agent_presets.py",), ("tests/sampling/test_serve_load.py",),
]  # fmt: skip
_GROUP_OF = {module: group[0] for group in ONE_WORKER for module in group}
# - The modules with the longest tests start first, so that no worker is left alone at the end
#   with one of them.
START_FIRST = [
    "tests/test_aot.py", "tests/test_gcs.py", "tests/test_multiprocess.py", "tests/test_sweep.py",
    "tests/rl/test_grpo.py",
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """START_FIRST's modules first, each module's tests still together and in order."""
    rank = {module: i for i, module in enumerate(START_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's `load` scheduling (one test at a time to whichever worker is free), except that
    the tests of each ONE_WORKER group go to one worker together (sent first: xdist sends the
    largest groups first)."""
    if config.getvalue("dist") != "load":
        return None  # another --dist asked for explicitly
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _GROUP_OF.get(nodeid.split("::")[0], nodeid)

    return Scheduling(config, log)
