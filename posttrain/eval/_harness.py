"""The evaluation harness: a suite of general, target and safety tasks on one model
(`evaluate`), on every checkpoint of a run (`evaluate_checkpoints`, which `posttrain eval` runs).

    posttrain eval --workdir=runs/demo/sft --config=configs/eval.py:demo    # CPU, ~30 s

Metrics are flat: `general/<task>/loss`, `target/<task>/accuracy`, `safety/<task>/refusal_rate`
... (docs/eval.md lists them). A run's results go to `<workdir>/eval/`: `metrics.jsonl` (one
line per checkpoint: step, metrics), `table.md` and `table.csv` (one row per checkpoint, one
column per metric), so a regression between checkpoints shows as a column that drops.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
from collections.abc import Callable, Iterable

import jax

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.data import load_tokenizer
from posttrain.eval._config import CATEGORIES, check_files, load_eval_config
from posttrain.eval._long_context import long_context_metrics, write_heatmaps
from posttrain.eval._tasks import Scorer, general_metrics, safety_metrics, target_metrics


def evaluate(
    model,
    tokenizer,
    config,
    *,
    scorer: Scorer | None = None,
    render_path: Callable[[str], str] | None = None,
) -> dict[str, float]:
    """Runs every task of a suite on one model.

    Args:
      model: a `Transformer` (e.g. `load_checkpoint_model(workdir)` or `from_hf(path)`).
      tokenizer: its `Tokenizer`, or a tokenizer directory.
      config: an `EvalConfig`, a ConfigDict / dict of one, or "configs/eval.py:<preset>".
      scorer: the verifiers to score with (default: built from `config`, closed at the end).
      render_path: `task name -> PNG path` (local or gs://) where a target task with `cad`
        records draws the parts of its first `renders` greedy completions; None: no renders.

    Returns:
      Flat metrics: `general/<task>/{loss,perplexity,tokens}`,
      `target/<task>/{accuracy,accuracy/<domain>,pass@<k>,examples}` or
      `target/<task>/{prefers_chosen,examples}`, `safety/<task>/{refusal_rate,compliance_rate,
      examples}`, `long_context/<task>/{accuracy,accuracy/L<length>_d<depth>,examples}`.
    """
    config = load_eval_config(config)
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    own = scorer is None
    scorer = Scorer(config) if own else scorer
    metrics: dict[str, float] = {}
    try:
        for category, task in config.tasks():
            if category == "general":
                out = general_metrics(model, tokenizer, task, progress=config.progress)
            elif category == "target":
                render_to = render_path(task.name) if render_path else ""
                out = target_metrics(model, tokenizer, task, scorer, progress=config.progress,
                                     render_to=render_to, engine=config.engine)  # fmt: skip
            elif category == "long_context":
                out = long_context_metrics(model, tokenizer, task, progress=config.progress)
            else:
                out = safety_metrics(model, tokenizer, task, scorer, progress=config.progress,
                                     engine=config.engine)  # fmt: skip
            metrics.update({f"{category}/{task.name}/{k}": v for k, v in out.items()})
    finally:
        if own:
            scorer.close()
    return metrics


def checkpoint_steps(workdir: str) -> list[int]:
    """The steps a run directory holds checkpoints of, in order."""
    from posttrain.train import CheckpointConfig, Checkpointer

    checkpointer = Checkpointer(workdir, CheckpointConfig(async_save=False))
    try:
        return sorted(checkpointer.manager.all_steps())
    finally:
        checkpointer.close()


def _run_tokenizer(workdir: str) -> str:
    """The tokenizer directory a run's config.json names."""
    path = paths.path(workdir) / "config.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    tokenizer = saved.get("tokenizer") or saved.get("model", {}).get("hf_path")
    if not tokenizer:
        raise ValueError(f"{path} names no tokenizer; pass --tokenizer=DIR (or set tokenizer)")
    return tokenizer


def suite_evaluator(suite) -> Callable[[object, object], dict[str, float]]:
    """`(model, tokenizer) -> metrics` of a suite, for a training run's periodic eval
    (`SFTConfig.eval_suite`): the suite's files are checked now, before the run compiles.

    Raises:
      ConfigError: a multi-process run (the suite runs on one process).
      FileNotFoundError: a task's data file is missing.
    """
    if jax.process_count() > 1:
        raise ConfigError(
            "eval_suite runs on one process; in a multi-process run evaluate the "
            "checkpoints with `posttrain eval --workdir=...` instead"
        )
    config = load_eval_config(suite)
    check_files(config)
    config = dataclasses.replace(config, progress=False)  # under the train bar
    return lambda model, tokenizer: evaluate(model, tokenizer, config)


def evaluate_checkpoints(
    path: str,
    config,
    steps: int | Iterable[int] | None = None,
    *,
    tokenizer: str | None = None,
    out_dir: str | None = None,
    console=None,
    mesh=None,
) -> list[dict]:
    """Evaluates checkpoints of a run (or an HF model directory) and writes the report.

    Args:
      path: a training workdir (`checkpoints/` inside) or an HF model directory.
      config: the suite (see `evaluate`).
      steps: the checkpoint step(s) to evaluate; default every checkpoint of the run.
      tokenizer: tokenizer directory; default the config's, else the run's (or the HF dir).
      out_dir: where the report goes; default `<path>/eval`.
      console: a `rich.console.Console` for the tables (default: stdout).
      mesh: a device mesh to shard each model over (fsdp x tensor...), for a checkpoint too
        big for one device; default the first device.

    Returns:
      One `{"step", "model", "metrics"}` per checkpoint evaluated (step None for an HF dir).
      `<out_dir>/metrics.jsonl` keeps a line per step (re-evaluating a step replaces its line);
      `table.md` and `table.csv` show every step it holds; each long-context task adds a
      heatmap per evaluated step (`<task>_step<N>.png`), each target task with `cad` records
      a grid of its first completions' parts (`renders/<task>_step<N>.png`; `_model` for an
      HF directory).
    """
    from posttrain.lora import load_checkpoint_model
    from posttrain.models import from_hf

    config = load_eval_config(config)
    steps = [steps] if isinstance(steps, int) else None if steps is None else list(steps)
    if (paths.path(path) / "checkpoints").is_dir():
        available = checkpoint_steps(path)
        if missing := sorted(set(steps or ()) - set(available)):
            raise ValueError(f"{path} has no checkpoint at step(s) {missing}; it has {available}")
        steps = available if steps is None else steps
        if not steps:
            raise ValueError(f"{path}/checkpoints holds no checkpoint")
        tokenizer = tokenizer or config.tokenizer or _run_tokenizer(path)
        loads = [(s, lambda s=s: load_checkpoint_model(path, s, mesh=mesh)) for s in steps]
    elif (paths.path(path) / "config.json").is_file():
        if steps:
            raise ValueError(f"{path} is an HF model directory: it has no steps to choose")
        tokenizer = tokenizer or config.tokenizer or path
        loads = [(None, lambda: from_hf(path, mesh=mesh))]
    else:
        raise FileNotFoundError(
            f"{path!r} is neither a training workdir (checkpoints/) nor an HF model directory "
            "(config.json)"
        )
    check_files(config)  # every missing data file named, before any model loads
    tokenizer = load_tokenizer(tokenizer)
    scorer = Scorer(config)
    out_dir = out_dir or paths.join(path, "eval")
    rows = []
    on_mesh = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    try:
        with on_mesh:
            for step, load in loads:
                label = "model" if step is None else f"step{step}"
                render_path = lambda task, label=label: paths.join(
                    out_dir, "renders", f"{task}_{label}.png"
                )
                metrics = evaluate(load(), tokenizer, config, scorer=scorer,
                                   render_path=render_path)  # fmt: skip
                rows.append({"step": step, "model": str(paths.path(path)), "metrics": metrics})
    finally:
        scorer.close()
    every = write_report(out_dir, rows)
    write_heatmaps(out_dir, rows, config.long_context)
    print_tables(every, title=path, console=console)
    return rows


def write_report(out_dir: str, rows: list[dict]) -> list[dict]:
    """Merges `rows` into `<out_dir>/metrics.jsonl` (by step) and rewrites table.md/.csv;
    returns every row the report now holds, in step order. `out_dir` may be gs://."""
    path = paths.path(out_dir) / "metrics.jsonl"
    by_step = {}
    if path.is_file():
        lines = filter(str.strip, path.read_text().splitlines())
        by_step = {r["step"]: r for r in map(json.loads, lines)}
    by_step.update({r["step"]: r for r in rows})
    every = sorted(by_step.values(), key=lambda r: -1 if r["step"] is None else r["step"])
    paths.write_text(path, "".join(json.dumps(r) + "\n" for r in every))
    names = _columns(every)
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["step", *names])
    for r in every:
        writer.writerow([_step(r), *(r["metrics"].get(n, "") for n in names)])
    paths.write_text(paths.join(out_dir, "table.csv"), table.getvalue())
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in every:
        cells = [_format(n, r["metrics"].get(n)) for n in names]
        lines.append(f"| {_step(r)} | " + " | ".join(cells) + " |")
    paths.write_text(paths.join(out_dir, "table.md"), "\n".join(lines) + "\n")
    return every


def print_tables(rows: list[dict], *, title: str = "", console=None) -> None:
    """A rich table per category: a row per metric, a column per checkpoint (the report's
    tables turned, so that many metrics fit a terminal)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    names = _columns(rows)
    for category in CATEGORIES:
        metrics = [n for n in names if n.startswith(category + "/")]
        if not metrics:
            continue
        table = Table(title=f"{category} · {title}" if title else category)
        table.add_column("metric")
        for r in rows:
            table.add_column(f"step {_step(r)}" if r["step"] is not None else "model",
                             justify="right")  # fmt: skip
        for n in metrics:
            cells = (_format(n, r["metrics"].get(n)) for r in rows)
            table.add_row(n.removeprefix(category + "/"), *cells)
        console.print(table)


def _columns(rows: list[dict]) -> list[str]:
    """Metric names in category order, then in the order tasks reported them."""
    names = list(dict.fromkeys(n for r in rows for n in r["metrics"]))
    return sorted(names, key=lambda n: CATEGORIES.index(n.split("/")[0]))


def _step(row: dict) -> str:
    return "model" if row["step"] is None else str(row["step"])


def _format(name: str, value) -> str:
    if value is None:
        return ""
    if name.endswith(("/examples", "/tokens")):
        return str(int(value))
    return f"{value:.4f}"
