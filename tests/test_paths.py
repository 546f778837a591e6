"""posttrain.paths on local folders and on a GCS emulator (objects checked with Google's client)."""

import json
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import paths
from posttrain.data import load_tokenizer
from posttrain.data._sources import Records
from posttrain.demo import ASSETS_DIR
from posttrain.models import Transformer, from_hf, get_preset, init_params, to_hf
from posttrain.train import MetricsWriter, read_metrics
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer


def _objects(url: str) -> dict[str, bytes]:
    """Every object under `url` (gs://bucket/prefix) by name below the prefix, read with
    google-cloud-storage (which finds the emulator through STORAGE_EMULATOR_HOST)."""
    from google.cloud import storage

    bucket, prefix = url.removeprefix("gs://").split("/", 1)
    client = storage.Client()
    return {
        blob.name[len(prefix) + 1 :]: blob.download_as_bytes()
        for blob in client.list_blobs(bucket, prefix=prefix + "/")
    }


@pytest.fixture
def gcs(gcs_bucket):
    """A fresh prefix in the emulator's bucket."""
    return f"{gcs_bucket}/{uuid.uuid4().hex[:8]}"


def test_local_paths_are_expanded_absolute_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert os.fspath(paths.path("~/a/b")) == str(tmp_path / "a" / "b")
    assert os.fspath(paths.path("rel")) == str(tmp_path / "rel")
    assert not paths.is_remote(tmp_path) and paths.is_remote("gs://b/x")
    paths.write_text("out/sub/x.json", "{}")
    paths.write_text("out/sub/x.json", '{"a": 1}')
    assert os.listdir(tmp_path / "out" / "sub") == ["x.json"]  # no temporary left behind
    assert json.loads((tmp_path / "out/sub/x.json").read_text()) == {"a": 1}
    assert paths.glob(str(tmp_path / "out/**/*.json")) == [str(tmp_path / "out/sub/x.json")]
    assert paths.local_copy("out") == str(tmp_path / "out")
    paths.upload("out", "copy")
    assert (tmp_path / "copy/sub/x.json").read_text() == '{"a": 1}'


def test_objects_written_listed_downloaded_and_uploaded(gcs, tmp_path):
    paths.write_text(f"{gcs}/run/config.json", '{"a": 1}')
    paths.write_bytes(f"{gcs}/run/sub/w.bin", b"\x00\x01\x02")
    assert _objects(gcs) == {"run/config.json": b'{"a": 1}', "run/sub/w.bin": b"\x00\x01\x02"}
    assert not (tmp_path / "gs:").exists() and not os.path.exists("gs:")
    assert paths.glob(f"{gcs}/**/*.bin") == [f"{gcs}/run/sub/w.bin"]
    assert paths.path(f"{gcs}/run").is_dir() and paths.path(f"{gcs}/run/config.json").is_file()

    local = paths.local_copy(f"{gcs}/run")
    assert not paths.is_remote(local)
    assert open(os.path.join(local, "sub", "w.bin"), "rb").read() == b"\x00\x01\x02"
    paths.write_text(f"{gcs}/run/config.json", '{"a": 22}')  # changed: the cache is refreshed
    assert open(os.path.join(paths.local_copy(f"{gcs}/run"), "config.json")).read() == '{"a": 22}'

    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f.txt").write_text("f")
    paths.upload(tmp_path / "d", f"{gcs}/up")
    assert _objects(f"{gcs}/up") == {"e/f.txt": b"f"}


def test_checkpoints_and_metrics_in_the_bucket(gcs):
    state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.asarray(3)}
    checkpointer = Checkpointer(gcs, CheckpointConfig(async_save=False))
    checkpointer.save(3, state, data_state={"pos": 7}, extra={"manifest": {"n": 1}}, force=True)
    checkpointer.close()
    names = _objects(gcs)
    assert "checkpoints/3/state/_METADATA" in names
    assert json.loads(names["checkpoints/3/manifest/metadata"]) == {"n": 1}

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    checkpointer = Checkpointer(gcs, CheckpointConfig(async_save=False))
    step, restored, data_state, extra = checkpointer.restore(abstract)
    checkpointer.close()
    assert step == 3 and data_state == {"pos": 7} and extra == {"manifest": {"n": 1}}
    np.testing.assert_array_equal(restored["w"], state["w"])

    writer = MetricsWriter(gcs, upload_secs=1e9)
    for step in (1, 2, 3, 4):
        writer.write(step, {"loss": 1.0 / step})
    assert "metrics.jsonl" not in _objects(gcs)  # kept until a flush: no append on GCS
    writer.flush()
    assert [r["step"] for r in read_metrics(gcs)] == [1, 2, 3, 4]
    writer.close()
    resumed = MetricsWriter(gcs, resume_step=3)  # a run resumed from step 3 drops step 4
    resumed.write(4, {"loss": 0.5})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(gcs)] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
        (4, 0.5),
    ]
    assert any(n.startswith("tensorboard/events.out.tfevents") for n in _objects(gcs))


def test_data_tokenizer_and_hf_model_read_from_the_bucket(gcs, tmp_path):
    paths.upload(ASSETS_DIR / "tokenizer", f"{gcs}/tokenizer")
    paths.upload(ASSETS_DIR / "eval.jsonl", f"{gcs}/data/part-0.jsonl")
    paths.upload(ASSETS_DIR / "eval.jsonl", f"{gcs}/data/part-1.jsonl")
    remote = Records(f"{gcs}/data/*.jsonl")
    local = Records(str(ASSETS_DIR / "eval.jsonl"))
    assert len(remote) == 2 * len(local)
    assert [remote[i][0] for i in range(len(local))] == [local[i][0] for i in range(len(local))]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        Records(f"{gcs}/data/*.parquet")

    text = "12 + 30 = 42"
    assert load_tokenizer(f"{gcs}/tokenizer").encode(text) == load_tokenizer(
        ASSETS_DIR / "tokenizer"
    ).encode(text)

    config = get_preset("tiny")
    model = Transformer(init_params(config, jax.random.key(0)), config)
    to_hf(model, f"{gcs}/hf")
    assert {"config.json", "model.safetensors"} <= set(_objects(f"{gcs}/hf"))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % config.vocab_size
    np.testing.assert_array_equal(from_hf(f"{gcs}/hf")(tokens), model(tokens))
    # The model directory's tokenizer is copied to the local cache, its weights are not (from_hf
    # reads them in place).
    paths.upload(ASSETS_DIR / "tokenizer", f"{gcs}/hf")
    assert load_tokenizer(f"{gcs}/hf").encode(text) == load_tokenizer(f"{gcs}/tokenizer").encode(
        text
    )
    cached = os.listdir(paths.cache_dir() / "gs" / gcs.removeprefix("gs://") / "hf")
    assert "tokenizer.json" in cached and not any(n.endswith(".safetensors") for n in cached)
    with pytest.raises(ValueError, match="does not exist"):
        from_hf(f"{gcs}/missing")
