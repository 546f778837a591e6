"""An export to a destination that fills up or refuses writes: `posttrain export` exits 2 with one
line naming the destination and the cause, leaves no partial export (nor its staging folder)
behind, and leaves an export already there as it was. The filesystem is a small tmpfs the test
mounts (root only: skipped with a message where mounting is not allowed)."""

import dataclasses
import errno
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import cli
from posttrain.models import Transformer, get_preset, param_shapes
from posttrain.train import CheckpointConfig, Checkpointer
from tests.mounts import tmpfs

CONFIG = get_preset("tiny")
EXPORT_KB = 652  # one float32 export of the tiny model (du -sk)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs' workdirs, each a checkpoint of the tiny model with its own random params."""
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    config = {"model": {"hf_path": "", "checkpoint": ""}}
    model_config = json.loads(json.dumps(dataclasses.asdict(CONFIG), default=str))
    workdirs = []
    for name in ("a", "b"):
        params = jax.tree.map(
            lambda s: jnp.asarray(rng.normal(0, 0.1, s.shape).astype(s.dtype)),
            param_shapes(CONFIG),
        )
        checkpointer = Checkpointer(str(root / name), CheckpointConfig(async_save=False))
        extra = {"config": config, "model_config": model_config}
        checkpointer.save(1, {"params": Transformer(params, CONFIG).params}, extra=extra)
        checkpointer.close()
        workdirs.append(root / name)
    return workdirs


def _export(workdir, out) -> int:
    return cli.main(["export", f"--workdir={workdir}", f"--out={out}"])


def _snapshot(path) -> dict[str, bytes]:
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_full_disk_is_one_line_and_keeps_the_export_there(runs, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", EXPORT_KB * 3 // 2) as disk:  # room for one export
        assert _export(runs[0], disk / "hf") == 0
        before = _snapshot(disk / "hf")
        capsys.readouterr()
        files = _open_files()
        assert _export(runs[1], disk / "hf") == 2
        assert capsys.readouterr().err.splitlines() == [
            f"posttrain export: exporting to {disk}/hf failed: No space left on device; its "
            f"partial files were removed and {disk}/hf is as it was",
            "(--debug shows the traceback)",
        ]
        assert _open_files() == files  # the failed export's files are closed
        assert os.listdir(disk) == ["hf"]  # no staging folder left
        assert _snapshot(disk / "hf") == before  # the previous export, byte for byte

        assert _export(runs[1], disk / "new") == 2  # a new destination: nothing left either
        assert f"exporting to {disk}/new failed: No space left" in capsys.readouterr().err
        assert os.listdir(disk) == ["hf"]


def test_a_read_only_destination_is_one_line(runs, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", 4 * EXPORT_KB) as disk:
        assert _export(runs[0], disk / "hf") == 0
        before = _snapshot(disk / "hf")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        for out in (disk / "hf", disk / "sub" / "hf"):
            capsys.readouterr()
            assert _export(runs[1], out) == 2
            assert capsys.readouterr().err.splitlines() == [
                f"posttrain export: exporting to {out} failed: Read-only file system; nothing "
                "was written",
                "(--debug shows the traceback)",
            ]
        assert os.listdir(disk) == ["hf"]
        assert _snapshot(disk / "hf") == before


def test_only_the_exports_own_write_errors_are_reworded(tmp_path):
    """A write error in the staging folder (or naming no file) becomes one line about the
    destination with the cause's errno; an error about another file (a checkpoint being read,
    say) passes through as it is."""
    from posttrain.models._staged_export import staged_export

    out = tmp_path / "hf"
    with pytest.raises(OSError) as refused:
        with staged_export(str(out), shared=True):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert refused.value.errno == errno.ENOSPC
    assert str(refused.value) == (
        f"exporting to {out} failed: No space left on device; its partial files were removed "
        f"and {out} is as it was"
    )
    elsewhere = str(tmp_path / "run" / "checkpoints" / "1" / "state")
    with pytest.raises(FileNotFoundError) as passed:
        with staged_export(str(out), shared=True):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), elsewhere)
    assert passed.value.filename == elsewhere
    assert os.listdir(tmp_path) == []  # no staging folder left, no export made
