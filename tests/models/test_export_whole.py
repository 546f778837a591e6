"""Exports are whole: `to_hf` into a previous export replaces it, never mixes old and new."""

import contextlib
import os
import pathlib
import re
import shutil
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models import (
    HFFormatError,
    Transformer,
    forward,
    from_hf,
    get_preset,
    param_shapes,
    to_hf,
)

CONFIG = get_preset("tiny")
TOKENS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % CONFIG.vocab_size
SHARDED = {"max_shard_bytes": 150_000}  # splits the tiny model into several shards
SINGLE = {}


@pytest.fixture(scope="module")
def models():
    """Two tiny models with different random params (numpy draws: init_params takes seconds)."""
    rng = np.random.default_rng(0)

    def draw(s):
        return jnp.asarray(rng.normal(0, 0.1, s.shape).astype(s.dtype))

    return [Transformer(jax.tree.map(draw, param_shapes(CONFIG)), CONFIG) for _ in range(2)]


@jax.jit
def _logits(params):
    return forward(params, TOKENS, CONFIG)


def _assert_loads_as(path, model):
    np.testing.assert_array_equal(
        np.asarray(_logits(from_hf(str(path)).params)), np.asarray(_logits(model.params))
    )


def _weight_files(path) -> list[str]:
    """The export's weight files and index (local or gs://); checks a sharded export's names
    are one set."""
    files = sorted(p.name for p in paths.path(path).iterdir() if "safetensors" in p.name)
    if files != ["model.safetensors"]:
        n = len(files) - 1
        shards = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert n >= 2 and files == [*shards, "model.safetensors.index.json"], files
    return files


@pytest.mark.parametrize(
    "first, second",
    [(SHARDED, SINGLE), (SINGLE, SHARDED)],
    ids=["sharded-single", "single-sharded"],
)
def test_reexport_replaces_the_previous_export(models, tmp_path, first, second):
    out = tmp_path / "hf"
    to_hf(models[0], str(out), **first)
    old = _weight_files(out)
    (out / "tokenizer.json").write_text("{}")  # copied in by the user: stays
    to_hf(models[1], str(out), **second)

    new = _weight_files(out)
    assert (len(old) == 1) == (first is SINGLE) and (len(new) == 1) == (second is SINGLE)
    assert sorted(os.listdir(out)) == sorted(["config.json", "tokenizer.json", *new])
    assert os.listdir(tmp_path) == ["hf"]  # the staging folder is gone
    _assert_loads_as(out, models[1])


@pytest.mark.parametrize(
    "first, second",
    [(SHARDED, SINGLE), (SINGLE, SHARDED)],
    ids=["sharded-single", "single-sharded"],
)
def test_reexport_to_gcs_replaces_the_objects(models, gcs_bucket, first, second):
    url = f"{gcs_bucket}/{uuid.uuid4().hex[:8]}/hf"
    to_hf(models[0], url, **first)
    _assert_loads_as(url, models[0])  # a reader's download cache now holds the first export
    to_hf(models[1], url, **second)
    new = _weight_files(url)
    assert (len(new) == 1) == (second is SINGLE)
    assert sorted(p.name for p in paths.path(url).iterdir()) == sorted(["config.json", *new])
    _assert_loads_as(url, models[1])


def _snapshot(path) -> dict[str, bytes]:
    """Every file below `path` (relative name) with its bytes."""
    return {
        os.path.relpath(os.path.join(root, f), path): pathlib.Path(root, f).read_bytes()
        for root, _, files in os.walk(path)
        for f in files
    }


def test_non_model_directory_is_refused_unless_overwrite(models, tmp_path):
    workdir = tmp_path / "run"  # a training workdir: exporting into it is a mistake
    (workdir / "checkpoints" / "100").mkdir(parents=True)
    (workdir / "checkpoints" / "100" / "state").write_bytes(b"\x00\x01")
    (workdir / "config.json").write_text('{"method": "sft"}')
    (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(workdir)

    with pytest.raises(
        UserError, match=rf"{re.escape(str(workdir))}.*empty directory.*--overwrite"
    ):
        to_hf(models[0], str(workdir))
    assert _snapshot(workdir) == before
    assert os.listdir(tmp_path) == ["run"]  # no staging folder left behind

    to_hf(models[0], str(workdir), overwrite=True)
    after = _snapshot(workdir)
    assert set(after) == {*before, "model.safetensors"}
    assert all(after[f] == before[f] for f in before if f != "config.json")  # the export's own
    _assert_loads_as(workdir, models[0])


class _Killed(Exception):
    pass


class _KillAt:
    """Stands in for a kill: raises at the `at`-th file operation (move in, delete) in `out`."""

    def __init__(self, out, at: int, monkeypatch):
        self.prefix, self.at, self.ops = str(out) + os.sep, at, 0
        replace, gpath = os.replace, type(paths.path(out))
        unlink = gpath.unlink
        monkeypatch.setattr(os, "replace", lambda src, dst: self(lambda d: replace(src, d), dst))
        monkeypatch.setattr(gpath, "unlink", lambda p, **kw: self(unlink, p, **kw))

    def __call__(self, op, target, *args, **kwargs):
        if str(target).startswith(self.prefix):
            self.ops += 1
            if self.ops == self.at:
                raise _Killed
        return op(target, *args, **kwargs)


@pytest.mark.parametrize(
    "first, second",
    [(SHARDED, SINGLE), (SINGLE, SHARDED), (SHARDED, SHARDED)],  # the last: same file names
    ids=["sharded-single", "single-sharded", "sharded-sharded"],
)
def test_a_kill_midway_never_loads_a_mix(models, tmp_path, monkeypatch, first, second):
    """Stops the replacement at each of its file operations in turn: the folder then loads the
    old model, the new one, or fails loudly, and rerunning the export is accepted."""
    out = tmp_path / "hf"
    for at in range(1, 100):
        to_hf(models[0], str(out), **first)
        kill = _KillAt(out, at, monkeypatch)
        with contextlib.suppress(_Killed):
            to_hf(models[1], str(out), **second)
        monkeypatch.undo()
        if kill.ops < at:  # the export finished: a kill at every step has been tried
            break
        try:
            loaded = np.asarray(_logits(from_hf(str(out)).params))
        except HFFormatError:
            pass  # loud: the rerun below is the fix
        else:
            assert any(np.array_equal(loaded, _logits(m.params)) for m in models), at
        to_hf(models[1], str(out), **second)  # the rerun is accepted and finishes the job
        _assert_loads_as(out, models[1])
        shutil.rmtree(out)
    assert at > 5  # the replacement took that many steps (and each was tried)
