"""Runs whose workdir is a gs:// URL, against the GCS emulator the `gcs_bucket` fixture starts
(found through STORAGE_EMULATOR_HOST only): SFT killed and resumed from the bucket, exported
from it; GRPO reading its prompts and tokenizer from the bucket, preempted and resumed from it."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import paths
from posttrain.demo import ASSETS_DIR
from posttrain.methods import run_from_config
from posttrain.models import from_hf
from posttrain.train import load_checkpoint_model, read_metrics
from tests.launch import REPO, finish
from tests.rl.toy import toy_config
from tests.train.conftest import start_run

STEPS = 8  # checkpoints every 4 (tests/train/conftest.py SMALL)


def _names(url: str) -> set[str]:
    """Object names under `url`, listed by google-cloud-storage (not by the code under test)."""
    from google.cloud import storage

    bucket, prefix = url.removeprefix("gs://").split("/", 1)
    blobs = storage.Client().list_blobs(bucket, prefix=prefix + "/")
    return {b.name[len(prefix) + 1 :] for b in blobs}


def _committed(url: str, step: int) -> bool:
    return f"checkpoints/{step}/commit_success.txt" in _names(url)  # Orbax's mark on GCS


def _losses(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(str(workdir))]


def test_sft_in_a_bucket_resumes_exactly_and_exports(gcs_bucket, tmp_path):
    url = f"{gcs_bucket}/sft"
    straight = start_run(tmp_path / "local", train__steps=STEPS)  # the uninterrupted reference
    process = start_run(url, step_delay=0.3, train__steps=STEPS)
    deadline = time.time() + 240
    while not _committed(url, 4):
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            pytest.fail(f"no checkpoint 4 in the bucket:\n{process.communicate()[0][-3000:]}")
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not _committed(url, STEPS)
    assert f"STOPPED completed {STEPS}" in finish(start_run(url, train__steps=STEPS))
    finish(straight)

    names = _names(url)
    assert {"config.json", "manifest.json", "metrics.jsonl"} <= names
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in names)
    assert {f"checkpoints/{s}/state/_METADATA" for s in (4, 8)} <= names
    assert _losses(url) == _losses(tmp_path / "local")  # bitwise, every step 1..8 logged once
    assert [s for s, _ in _losses(url)] == list(range(1, STEPS + 1))
    model = load_checkpoint_model(url, STEPS)
    local = load_checkpoint_model(str(tmp_path / "local"), STEPS)
    for x, y in zip(jax.tree.leaves(model.params), jax.tree.leaves(local.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    subprocess.run(
        [sys.executable, "-m", "posttrain", "export", f"--workdir={url}", f"--out={url}/hf"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert {"hf/config.json", "hf/model.safetensors"} <= _names(url)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % model.config.vocab_size
    np.testing.assert_array_equal(from_hf(f"{url}/hf")(tokens), model(tokens))


@pytest.mark.slow  # the SFT test above resumes from the bucket through the same loop (~60 s)
def test_grpo_in_a_bucket_resumes_exactly(gcs_bucket, tmp_path):
    url = f"{gcs_bucket}/grpo"
    paths.upload(ASSETS_DIR / "tokenizer", f"{url}/inputs/tokenizer")
    paths.upload(ASSETS_DIR / "train.jsonl", f"{url}/inputs/train.jsonl")
    source = {"weight": 1.0, "domain": "arithmetic", "format": "auto"}
    in_bucket = toy_config(
        train__steps=3,
        tokenizer=f"{url}/inputs/tokenizer",
        data__sources=[{"path": f"{url}/inputs/train.jsonl", **source}],
    )

    def preempt(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    # Step 1's metrics reach the host after step 2 is dispatched: the save is at step 2.
    stopped = run_from_config(in_bucket, f"{url}/run", on_metrics=preempt)
    assert stopped["stopped"] == "preempted" and stopped["final_step"] == 2
    names = _names(f"{url}/run")
    assert {"config.json", "prompts.json", "metrics.jsonl"} <= names
    assert _committed(f"{url}/run", 2)
    assert run_from_config(in_bucket, f"{url}/run")["final_step"] == 3  # resumed from the bucket

    run_from_config(toy_config(train__steps=3), str(tmp_path))  # uninterrupted, on local disk
    remote, local = read_metrics(f"{url}/run"), read_metrics(str(tmp_path))
    assert [r["step"] for r in remote] == [1, 2, 3]
    for key in ("reward", "loss"):
        assert [r[key] for r in remote] == [r[key] for r in local], key
    restored = load_checkpoint_model(f"{url}/run")
    expected = load_checkpoint_model(str(tmp_path))
    for x, y in zip(
        jax.tree.leaves(restored.params), jax.tree.leaves(expected.params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
