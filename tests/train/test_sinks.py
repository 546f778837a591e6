"""`train.log_to`: the trackers are optional (posttrain imports neither), a wrong setting is one
error before anything trains, a run resumed in its workdir logs into the same tracker run, and
a tracker that fails mid-run costs only its own metrics. (What W&B and MLflow receive from a
real run, compared with metrics.jsonl: tests/train/test_sft.py.)"""

import json
import logging
import subprocess
import sys

import pytest

from posttrain.errors import UserError
from posttrain.train import LoopConfig, read_metrics
from posttrain.train._metrics import MetricsWriter


def test_posttrain_runs_without_the_trackers_installed(tmp_path, monkeypatch):
    blocked = "import sys; sys.modules.update(wandb=None, mlflow=None)\n"
    program = blocked + "import posttrain.cli, posttrain.methods, posttrain.train\nprint('ok')"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    writer = MetricsWriter(str(tmp_path), log_to=("jsonl", "tensorboard"))
    writer.write(1, {"loss": 2.0})
    writer.close()
    assert read_metrics(str(tmp_path)) == [{"step": 1, "split": "train", "loss": 2.0}]
    for name, extra in (("wandb", "wandb"), ("mlflow", "mlflow")):
        with pytest.raises(UserError, match=rf"names '{name}', which is not installed: pip "
                           rf"install 'posttrain\[{extra}\]'"):  # fmt: skip
            MetricsWriter(str(tmp_path / name), log_to=("jsonl", name))


def test_bad_settings_are_one_error_before_training(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"train.log_to names \['comet'\]; choose among"):
        LoopConfig(log_to=("jsonl", "comet"))
    with pytest.raises(ValueError, match="must keep 'jsonl': resume, sweeps"):
        LoopConfig(log_to=("tensorboard",))
    # A tracking server that does not answer: the run does not start.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(UserError, match=r"train.log_to 'mlflow' could not start a run \("):
        MetricsWriter(str(tmp_path), log_to=("jsonl", "mlflow"), mlflow_uri="http://127.0.0.1:9")


def test_a_resumed_run_logs_into_the_same_mlflow_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = {"config": {"train": {"steps": 4}}, "data_builds": "none"}
    # A run killed after logging step 3 whose checkpoint is at 2, then resumed from 2: step 3
    # is logged again.
    for resume, steps in ((None, (1, 2, 3)), (2, (3, 4))):
        writer = MetricsWriter(str(tmp_path), log_to=("jsonl", "mlflow"), params=params,
                               resume_step=resume)  # fmt: skip
        for step in steps:
            writer.write(step, {"loss": 1.0 / step, "pass@1": 0.5})
        writer.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]  # the JSONL: once
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "posttrain"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    history = client.get_metric_history(run_id, "train/loss")
    assert {m.step: m.value for m in history} == {s: 1.0 / s for s in range(1, 5)}
    assert sorted(m.step for m in history) == [1, 2, 3, 3, 4]  # MLflow keeps both step 3s
    assert len(client.get_metric_history(run_id, "train/pass_1")) == 5
    assert client.get_run(run_id).data.params == {"config.train.steps": "4", "data_builds": "none"}


def test_a_tracker_that_fails_mid_run_costs_only_its_metrics(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    writer = MetricsWriter(str(tmp_path), log_to=("jsonl", "mlflow"))
    writer.write(1, {"loss": 1.0})
    store = tmp_path / "mlruns"
    store.rename(tmp_path / "mlruns.gone")
    store.write_text("not a folder any more")  # its writes now fail
    with caplog.at_level(logging.WARNING):
        for step in (2, 3):
            writer.write(step, {"loss": 1.0 / step})
    writer.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    warned = [r for r in caplog.records if "train.log_to 'mlflow' failed" in r.getMessage()]
    assert len(warned) == 1 and "the run goes on without it" in warned[0].getMessage()


def test_mlflow_keeps_a_metric_whose_name_is_below_another_s(tmp_path, monkeypatch):
    """RL logs `reward` and `reward/<domain>` each step: a file store keeps a metric as a file
    under folders of its name, so "/" inside a metric's name becomes "." (`train/reward.math`);
    with "/" the second name failed ("Not a directory") and the tracker was dropped."""
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    writer = MetricsWriter(str(tmp_path), log_to=("jsonl", "mlflow"), params={})
    for step in (1, 2):
        writer.write(step, {"reward": 0.5 * step, "reward/math": 0.25 * step, "a/b/c": 1.0})
    writer.close()
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert client.get_run(run_id).data.metrics == {
        "train/reward": 1.0,
        "train/reward.math": 0.5,
        "train/a.b.c": 1.0,
    }
    history = client.get_metric_history(run_id, "train/reward.math")
    assert {m.step: m.value for m in history} == {1: 0.25, 2: 0.5}
