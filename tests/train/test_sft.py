"""The SFT driver end to end: train, export to HF, presets shape-checked."""

import functools
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import cli
from posttrain.config import build, load_config_file
from posttrain.methods import SFTConfig, run_from_config
from posttrain.testing import hf_logits
from posttrain.train import (
    create_state,
    load_checkpoint_model,
    make_optimizer,
    read_metrics,
    sft_loss,
    train_step,
)
from posttrain.train._sinks import mlflow_name
from tests.train.conftest import REPO, small_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, devices):
    workdir = tmp_path_factory.mktemp("sft")
    config = small_config(**{"train__steps": 30, "optimizer__warmup_steps": 5})
    config.eval_data = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny").eval_data
    config.train.eval_every = 15
    # Every sink: W&B offline (its files in the workdir), MLflow's file store in the workdir.
    config.train.log_to = ["jsonl", "tensorboard", "wandb", "mlflow"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = run_from_config(config, str(workdir))
    return workdir, summary


def test_training_lowers_the_loss_and_logs_everything(trained):
    workdir, summary = trained
    train = read_metrics(str(workdir), "train")
    assert [r["step"] for r in train] == list(range(1, 31))
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    evals = read_metrics(str(workdir), "eval")
    assert [r["step"] for r in evals] == [15, 30] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert os.listdir(workdir / "tensorboard")  # event files
    manifest = (workdir / "manifest.json").read_text()
    assert "sha256" in manifest and "train.jsonl" in manifest
    assert summary["stopped"] == "completed" and summary["data"]["used"] > 0
    counts = {k: summary["data"][k] for k in ("truncated", "dropped", "skipped", "no_loss")}
    assert {k: train[-1][f"data/{k}"] for k in counts} == counts  # the records' accounting


def _wandb_run(path) -> tuple[dict, dict]:
    """({step: {key: value}}, config) of an offline W&B run file: the LevelDB log format (after
    a 7-byte file header, 32 KiB blocks of records, each with a 7-byte header: crc32, length,
    type) of `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, history, config = 7, b"", {}, {}
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row = history.setdefault(record.history.step.num, {})
                row.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.history.item})  # fmt: skip
            elif record.WhichOneof("record_type") in ("run", "config"):  # (config: updates)
                items = (record.run.config if record.HasField("run") else record.config).update
                config.update({i.key: json.loads(i.value_json) for i in items})
    return history, config


def test_wandb_and_mlflow_get_the_jsonl_metrics_and_the_runs_parameters(trained):
    """`train.log_to` with W&B (offline) and MLflow (file store): per step, the same values
    as metrics.jsonl, for the train and eval splits; the run's config and data manifest as
    its parameters."""
    from mlflow import MlflowClient

    workdir, _ = trained
    expected = {}
    for split in ("train", "eval"):
        for row in read_metrics(str(workdir), split):
            step = row.pop("step")
            row.pop("split")
            expected.setdefault(step, {}).update({f"{split}/{k}": v for k, v in row.items()})
    assert len(expected) == 30 and len(expected[30]) >= 20  # (many metrics each step)
    ids = json.loads((workdir / "tracking.json").read_text())

    (run_file,) = workdir.glob(f"wandb/offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb")
    history, config = _wandb_run(run_file)
    logged = {step: {k: v for k, v in row.items() if not k.startswith("_")}
              for step, row in history.items()}  # fmt: skip
    assert logged == expected
    assert config["config"]["train"]["steps"] == 30 and config["data_builds"] == "none"
    assert "train.jsonl" in json.dumps(config["manifest"]["sources"])

    client = MlflowClient(tracking_uri=f"file:{workdir / 'mlruns'}")
    run = client.get_run(ids["mlflow"])
    for key in expected[30]:
        name = mlflow_name(key)
        values = {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        assert values == {s: row[key] for s, row in expected.items() if key in row}, key
    assert run.data.params["config.train.steps"] == "30" and run.info.status == "FINISHED"
    assert run.data.params["manifest.sources.0.files.0.sha256"] == json.loads(
        (workdir / "manifest.json").read_text())["sources"][0]["files"][0]["sha256"]  # fmt: skip


def test_sft_on_a_save_to_disk_folder_trains_as_on_its_jsonl(trained, tmp_path):
    """The same data as a `datasets` `save_to_disk` folder with its own column names (mapped
    back by the source's `columns`): its first steps log the fixture's losses exactly (the
    same batches; the learning rate is still in warm-up, the same for any run length)."""
    import datasets

    workdir, _ = trained
    config = small_config(**{"train__steps": 3, "optimizer__warmup_steps": 5})
    (source,) = config.data.sources
    names = {"messages": "conversation", "prompt": "question", "answer": "solution"}
    with open(source["path"]) as f:
        rows = [json.loads(line) for line in f]
    renamed = [{names.get(k, k): v for k, v in r.items()} for r in rows]
    datasets.DatasetDict(train=datasets.Dataset.from_list(renamed)).save_to_disk(tmp_path / "ds")
    config.data.sources = [{**source, "path": str(tmp_path / "ds"), "split": "train",
                            "columns": names}]  # fmt: skip
    run_from_config(config, str(tmp_path / "run"))
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "run"))]
    assert losses == [r["loss"] for r in read_metrics(str(workdir))[:3]]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["sources"][0]["split"] == "train" and manifest["sources"][0]["records"] == len(
        rows)  # fmt: skip


def test_export_writes_an_hf_model_with_the_same_logits(trained, tmp_path):
    workdir, _ = trained
    out = tmp_path / "hf"
    assert cli.main(["export", f"--workdir={workdir}", f"--out={out}"]) == 0
    model = load_checkpoint_model(str(workdir))
    tokens = np.random.RandomState(0).randint(0, 512, (2, 20)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(str(out), tokens), ours, atol=1e-4)


@pytest.mark.parametrize(
    "preset", ["llama3_8b_v5p", pytest.param("qwen3_32b_v5p", marks=pytest.mark.slow)]
)
def test_real_size_presets_shape_check(preset):
    """The full train step traces at the preset's real shapes (no weights allocated)."""
    values = load_config_file(os.path.join(REPO, "configs", "sft.py") + f":{preset}")
    config = build(SFTConfig, {k: v for k, v in values.items() if k != "method"})
    model_config = config.model.model_config()
    # (the remat policy `posttrain compile --remat-sweep` found fastest on the plan's slice)
    assert model_config.remat == "dots_no_batch" and model_config.compute_dtype == "bfloat16"
    optimizer = make_optimizer(config.optimizer, config.train.steps)
    from posttrain.models import param_shapes

    state = jax.eval_shape(
        functools.partial(create_state, optimizer=optimizer, seed=0), param_shapes(model_config)
    )
    rows, length = config.data.batch_size, config.data.max_len
    batch = {
        k: jax.ShapeDtypeStruct((rows, length), jnp.float32 if k == "loss_mask" else jnp.int32)
        for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")
    }
    step = functools.partial(
        train_step,
        loss_fn=sft_loss(model_config, 0.0),
        optimizer=optimizer,
        micro_batches=config.train.micro_batches,
    )
    new_state, metrics = jax.eval_shape(step, state, batch)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert metrics["loss"].shape == ()
