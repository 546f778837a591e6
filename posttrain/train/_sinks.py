"""Experiment trackers the train metrics also go to: Weights & Biases and MLflow.

`train.log_to` names the sinks: "jsonl" (`<workdir>/metrics.jsonl`, always: resume, sweeps and
`posttrain eval` read it), "tensorboard", "wandb", "mlflow". A tracker's package is imported
only when it is named, so posttrain runs without either installed.

Each tracker gets one run per workdir: its id is kept in `<workdir>/tracking.json`, so a run
resumed from a checkpoint logs into the same tracker run. Its parameters (logged once, when the
tracker run is created) are the run's config, its data manifest and the ids of the
`posttrain data build` folders it reads. Metrics are logged per step as `<split>/<name>`, the
JSONL's values (MLflow's names lose the characters it refuses, `pass@1` -> `pass_1`). A tracker
that fails mid-run (a server gone) costs its own metrics, with one warning, never the run.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import re
import time
import uuid

from posttrain import paths
from posttrain.errors import UserError

log = logging.getLogger(__name__)

LOG_TO = ("jsonl", "tensorboard", "wandb", "mlflow")
DEFAULT_PROJECT = "posttrain"
_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow-skinny"}


def check_log_to(log_to) -> None:
    """Raises ValueError for an unknown sink, or a `log_to` without "jsonl"."""
    unknown = [s for s in log_to if s not in LOG_TO]
    if unknown:
        raise ValueError(f"train.log_to names {unknown}; choose among {list(LOG_TO)}")
    if "jsonl" not in log_to:
        raise ValueError(
            "train.log_to must keep 'jsonl': resume, sweeps and `posttrain eval` read metrics.jsonl"
        )


def tracker_params(checkpoint_json: dict | None) -> dict:
    """A run's parameters for a tracker: config, model config, data manifest and build ids."""
    items = dict(checkpoint_json or {})
    manifest = items.get("manifest") or {}
    builds = [s["build"]["id"] for s in manifest.get("sources", []) if s.get("build")]
    return {**items, "data_builds": ",".join(builds) or "none"}


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts and lists as {"a.b.0.c": leaf}."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return {prefix: value}
    out = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _import(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise UserError(
            f"train.log_to names {name!r}, which is not installed: pip install "
            f"'posttrain[{name}]' (or {_EXTRAS[name]}), or take it out of train.log_to"
        ) from None


def _run_ids(workdir: str) -> dict:
    path = paths.path(workdir) / "tracking.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _keep_run_id(workdir: str, tracker: str, run_id: str) -> None:
    ids = {**_run_ids(workdir), tracker: run_id}
    paths.write_text(paths.path(workdir) / "tracking.json", json.dumps(ids, indent=2) + "\n")


class _Sink(abc.ABC):
    """A tracker; `write` swallows its errors after the first warning."""

    name = ""

    def __init__(self):
        self._failed = False

    def write(self, step: int, split: str, values: dict[str, float]) -> None:
        if self._failed:
            return
        try:
            self._write(step, split, values)
        except Exception as e:  # a tracker is never worth the run
            self._failed = True
            log.warning(
                "train.log_to %r failed (%s: %s); the run goes on without it (metrics.jsonl "
                "has every value)", self.name, type(e).__name__, str(e)[:300],
            )  # fmt: skip

    @abc.abstractmethod
    def _write(self, step: int, split: str, values: dict[str, float]) -> None:
        """Logs one step's values of one split."""

    @abc.abstractmethod
    def close(self) -> None:
        """Ends the tracker run."""


class WandbSink(_Sink):
    """A Weights & Biases run (offline with `WANDB_MODE=offline`: files under the workdir)."""

    name = "wandb"

    def __init__(self, workdir: str, *, project: str, run_name: str, params: dict):
        super().__init__()
        wandb = _import("wandb")
        run_id = _run_ids(workdir).get("wandb") or uuid.uuid4().hex[:8]
        # Its files: beside the run on local disk, else in W&B's own default directory.
        where = {} if paths.is_remote(workdir) else {"dir": os.fspath(paths.path(workdir))}
        self._run = wandb.init(
            project=project or DEFAULT_PROJECT, name=run_name or _name(workdir), id=run_id,
            resume="allow", config=params, reinit="create_new", **where,
        )  # fmt: skip
        _keep_run_id(workdir, "wandb", run_id)

    def _write(self, step, split, values) -> None:
        self._run.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink(_Sink):
    """An MLflow run: at `uri` (a server, a database, a folder), by default MLFLOW_TRACKING_URI,
    else a file store in `<workdir>/mlruns`."""

    name = "mlflow"
    _MAX_PARAM = 6000  # characters MLflow keeps of a parameter's value

    def __init__(self, workdir: str, *, uri: str, experiment: str, run_name: str, params: dict):
        super().__init__()
        _import("mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        if not uri:
            uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            if paths.is_remote(workdir):
                raise UserError(
                    "train.log_to has 'mlflow' with a gs:// workdir: set train.mlflow_uri (or "
                    "MLFLOW_TRACKING_URI) to a tracking server or database"
                )
            uri = "file:" + os.fspath(paths.path(workdir) / "mlruns")
            # MLflow 3 keeps its folder store in maintenance; it is what a local run wants.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        run_id = _run_ids(workdir).get("mlflow")
        if run_id is None:
            name = experiment or DEFAULT_PROJECT
            found = client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found else client.create_experiment(name)
            run = client.create_run(experiment_id, run_name=run_name or _name(workdir))
            run_id = run.info.run_id
            flat = [Param(k[:250], str(v)[: self._MAX_PARAM]) for k, v in flatten(params).items()]
            for i in range(0, len(flat), 100):  # MLflow's batch limit
                client.log_batch(run_id, params=flat[i : i + 100])
            _keep_run_id(workdir, "mlflow", run_id)
        self._run_id = run_id
        self.uri = uri

    def _write(self, step, split, values) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(f"{split}/{k}"), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def close(self) -> None:
        if not self._failed:
            self._client.set_terminated(self._run_id)


def mlflow_name(name: str) -> str:
    """`name` ("<split>/<metric>") as an MLflow metric name: the metric's own "/" made "." (a
    file store keeps a metric as a file under folders of its name's parts, so
    "train/reward/math" cannot sit beside "train/reward") and the characters MLflow refuses
    made "_"."""
    split, _, metric = name.partition("/")
    return re.sub(r"[^\w\-. :/]", "_", f"{split}/{metric.replace('/', '.')}" if metric else split)


def _name(workdir: str) -> str:
    return os.path.basename(str(workdir).rstrip("/")) or "run"


def open_sinks(
    workdir: str, log_to, *, project: str, run_name: str, mlflow_uri: str, params: dict
) -> list[_Sink]:
    """The trackers `log_to` names (process 0 only), each opened and ready."""
    opens = {
        "wandb": lambda: WandbSink(workdir, project=project, run_name=run_name, params=params),
        "mlflow": lambda: MlflowSink(
            workdir, uri=mlflow_uri, experiment=project, run_name=run_name, params=params
        ),  # fmt: skip
    }
    sinks: list[_Sink] = []
    for name in (n for n in opens if n in log_to):
        try:
            sinks.append(opens[name]())
        except UserError:
            raise
        except Exception as e:  # a tracker that cannot start: stop before anything trains
            for sink in sinks:
                sink.close()
            raise UserError(
                f"train.log_to {name!r} could not start a run ({type(e).__name__}: "
                f"{str(e)[:300]}); fix its settings (train.project, train.mlflow_uri, the "
                f"tracker's environment) or take it out of train.log_to"
            ) from None
    return sinks
