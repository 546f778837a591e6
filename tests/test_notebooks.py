"""The Colab quickstarts in notebooks/ run top to bottom, on CPU, with the quick settings.

Each notebook runs in a fresh kernel of this interpreter (its own kernel spec, written to
tmp_path, so no installed Jupyter kernel is used or needed) with POSTTRAIN_NOTEBOOK_QUICK=1 and
its runs under tmp_path; nothing is downloaded or installed.
"""

import glob
import json
import os
import re
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))
CELL_TIMEOUT_S = 300
KERNEL = "posttrain-test"


def _kernel_manager(folder, workdir: str) -> KernelManager:
    """A kernel of this interpreter with the quick settings, from a spec written to `folder`."""
    spec_dir = folder / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    # The conftest's 8 fake devices would only slow the notebooks' single-device runs down.
    xla_flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    ).strip()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "posttrain (test)",
        "language": "python",
        "env": {
            "POSTTRAIN_NOTEBOOK_QUICK": "1",
            "POSTTRAIN_NOTEBOOK_WORKDIR": workdir,
            "POSTTRAIN_CONFIGS": os.path.join(REPO, "configs"),
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": xla_flags,
            "HF_HUB_OFFLINE": "1",
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


def test_every_notebook_is_there():
    names = [os.path.basename(p) for p in NOTEBOOKS]
    assert names == [
        "01_sft.ipynb",
        "02_dpo.ipynb",
        "03_grpo.ipynb",
        "04_bring_your_own_hf_model.ipynb",
        "05_bring_your_own_flax_model.ipynb",
        "06_vision_language.ipynb",
    ]
    with open(os.path.join(REPO, "notebooks", "README.md")) as f:
        readme = f.read()
    for name in names:
        assert f"notebooks/{name})" in readme, f"notebooks/README.md does not link {name}"


def test_notebooks_are_stored_without_outputs():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        stored = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.outputs]
        assert not stored, f"{path}: cells {stored} have outputs; clear them before committing"


@pytest.mark.slow  # ~95 s; every notebook runs in test_every_notebook_runs_top_to_bottom
def test_sft_notebook_runs_top_to_bottom(tmp_path):
    # The others (02 and 03 reuse 01's SFT run, as a user would) run in `make test-slow`.
    _run_notebooks([p for p in NOTEBOOKS if os.path.basename(p).startswith("01")], tmp_path)


@pytest.mark.slow
def test_every_notebook_runs_top_to_bottom(tmp_path):
    _run_notebooks(NOTEBOOKS, tmp_path)


def _run_notebooks(notebooks, tmp_path):
    # One workdir: 02 and 03 reuse the SFT run of 01, as a user would.
    workdir = str(tmp_path / "runs")
    failures, seconds = [], {}
    for path in notebooks:
        name = os.path.basename(path)
        cwd = tmp_path / name.removesuffix(".ipynb")
        cwd.mkdir()
        nb = nbformat.read(path, as_version=4)
        kernel = _kernel_manager(cwd, workdir)
        client = NotebookClient(
            nb, km=kernel, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(cwd)}}
        )
        start = time.perf_counter()
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError) as e:
            failures.append(f"{name}: " + re.sub(r"\x1b\[[0-9;]*m", "", str(e)))  # no colours
        finally:
            if kernel.has_kernel:  # nbclient leaves a kernel manager it was given running
                kernel.shutdown_kernel(now=True)
        seconds[name] = round(time.perf_counter() - start, 1)
        nbformat.write(nb, str(cwd / name))  # with its outputs, for a look after a failure
    print("notebook seconds:", seconds)
    assert not failures, "\n\n".join(failures)
