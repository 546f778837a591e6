"""Config-driven sweeps: a grid or random search over config keys (`posttrain sweep`).

    posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/sweep    # CPU, ~2 min

A sweep file's `get_config()` names a base config and the keys to vary; every value combination
runs once per seed, one trial after another in this process, each in `<workdir>/<trial>` with a
`trial.json` record. Running the same command again skips finished trials, resumes killed ones
from their checkpoints and retries failed ones. Results go to `summary.csv` (one row per trial)
and `combinations.csv` (mean and std over seeds). docs/sweeps.md describes every field.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import hashlib
import itertools
import json
import math
import os
import random
import re
import shlex
import time
import traceback
from collections.abc import Mapping

import ml_collections

from posttrain._sweep_report import _print_summary, _write_csv, metric_history, summarize
from posttrain.config import ConfigError, load_config_file, override, to_plain
from posttrain.methods._record import method_config, run_from_config

# The fields of a sweep file and their defaults (None: required).
FIELDS = {
    "base": None,  # the config every trial starts from: "configs/sft.py:tiny"
    "overrides": {},  # dotted key -> value, applied to every trial
    "search": "grid",  # grid | random
    "grid": {},  # grid: dotted key -> list of values; every combination runs
    "space": {},  # random: dotted key -> {"values" | "log_uniform" | "uniform" | "int": ...}
    "num_trials": 0,  # random: value combinations drawn from `space`
    "seeds": [],  # each combination runs once per seed (train.seed and data.seed); []: base's
    "metric": "eval_loss",  # logged metric that ranks trials (a key of metrics.jsonl rows)
    "mode": "min",  # min | max: which end of `metric` is better
    "random_seed": 0,  # random: the draws are reproducible with this seed
}
DISTRIBUTIONS = ("values", "log_uniform", "uniform", "int")
SEED_KEYS = ("train.seed", "data.seed")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of the sweep: a value combination with one seed."""

    name: str  # directory under the sweep's workdir, built from `values` and `seed`
    values: dict  # the varied keys' values (the seed apart)
    seed: int | None  # None: the base config's seeds
    overrides: dict  # every dotted key the trial sets over the base: overrides, values, seeds


def _nearest(key: str, options) -> str:
    """' (nearest valid key: ...)', preferring keys with the same last name."""
    options = sorted(options)
    same_leaf = [o for o in options if o.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    match = difflib.get_close_matches(key, same_leaf or options, n=1, cutoff=0.0)
    return f" (nearest valid key: {match[0]!r})" if match else ""


def _flatten(values, where: str, is_leaf, prefix: str = "") -> dict:
    """Nested dicts to dotted keys: {"optimizer": {"lr": x}} -> {"optimizer.lr": x}."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"sweep {where}: expected a dict of dotted key -> value, got {values!r}")
    flat = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value and not is_leaf(value):
            flat.update(_flatten(value, where, is_leaf, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_sweep(path_or_config) -> dict:
    """The sweep's fields as plain values: defaults filled in, keys dotted, types checked.

    Args:
      path_or_config: a sweep file (`configs/sweeps/<name>.py`), or its ConfigDict / dict.
    """
    raw = load_config_file(path_or_config) if isinstance(path_or_config, str) else path_or_config
    values = to_plain(raw)
    if not isinstance(values, Mapping):
        raise ConfigError(f"sweep: expected a ConfigDict of sweep fields, got {values!r}")
    for key in values:
        if key not in FIELDS:
            raise ConfigError(f"sweep: unknown field {key!r}{_nearest(key, FIELDS)}")
    sweep = {**copy.deepcopy(FIELDS), **values}
    if not isinstance(sweep["base"], str) or not sweep["base"]:
        raise ConfigError("sweep base: name the config to start from, e.g. 'configs/sft.py:tiny'")
    if sweep["search"] not in ("grid", "random"):
        raise ConfigError(f"sweep search: 'grid' or 'random', got {sweep['search']!r}")
    if sweep["mode"] not in ("min", "max"):
        raise ConfigError(f"sweep mode: 'min' or 'max', got {sweep['mode']!r}")
    sweep["overrides"] = _flatten(sweep["overrides"], "overrides", lambda v: False)
    sweep["grid"] = _flatten(sweep["grid"], "grid", lambda v: False)
    sweep["space"] = _flatten(sweep["space"], "space", lambda v: bool(set(v) & {*DISTRIBUTIONS}))
    unused = "space" if sweep["search"] == "grid" else "grid"
    if sweep[unused]:
        raise ConfigError(f"sweep {unused}: not used by search={sweep['search']!r}; remove it")
    trials = sweep["num_trials"]
    if sweep["search"] == "random" and (
        not sweep["space"] or not isinstance(trials, int) or trials < 1
    ):
        raise ConfigError("sweep: search='random' needs a `space` and num_trials >= 1")
    seeds = sweep["seeds"]
    if not isinstance(seeds, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in seeds
    ):
        raise ConfigError(f"sweep seeds: expected a list of ints, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"sweep seeds: {seeds} lists a seed twice")
    varied, seed_keys = {*sweep["grid"], *sweep["space"]}, set(SEED_KEYS if seeds else ())
    for key in sorted((varied | seed_keys) & set(sweep["overrides"])):
        raise ConfigError(f"sweep: {key!r} is both in overrides and varied; keep one")
    for key in sorted(varied & seed_keys):
        raise ConfigError(f"sweep: {key!r} is varied and also set by `seeds`; keep one")
    return sweep


def grid_values(grid: Mapping[str, list]) -> list[dict]:
    """Every combination of the grid's values (the last key varies fastest)."""
    for key, values in grid.items():
        if not isinstance(values, list | tuple) or not values:
            raise ConfigError(f"sweep grid[{key!r}]: expected a non-empty list, got {values!r}")
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise ConfigError(f"sweep grid[{key!r}]: {list(values)} lists a value twice")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*grid.values())]


def _draw(rng: random.Random, key: str, spec):
    where = f"sweep space[{key!r}]"
    if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ConfigError(f"{where}: expected one of {{'values': [...]}}, {{'log_uniform': "
                          f"[low, high]}}, {{'uniform': [low, high]}}, {{'int': [low, high]}}; "
                          f"got {spec!r}")  # fmt: skip
    kind, arg = next(iter(spec.items()))
    if kind == "values":
        if not isinstance(arg, list | tuple) or not arg:
            raise ConfigError(f"{where}: 'values' needs a non-empty list, got {arg!r}")
        return rng.choice(list(arg))
    number = lambda x: isinstance(x, int | float) and not isinstance(x, bool)
    if not (isinstance(arg, list | tuple) and len(arg) == 2 and all(map(number, arg))):
        raise ConfigError(f"{where}: {kind!r} needs [low, high], got {arg!r}")
    low, high = arg
    if low > high or (kind == "log_uniform" and low <= 0):
        raise ConfigError(f"{where}: {kind!r} needs {'0 < ' if kind == 'log_uniform' else ''}"
                          f"low <= high, got {list(arg)}")  # fmt: skip
    if kind == "int":
        if not all(isinstance(x, int) for x in arg):
            raise ConfigError(f"{where}: 'int' bounds must be ints, got {list(arg)}")
        return rng.randint(low, high)  # both ends included
    if kind == "uniform":
        x = rng.uniform(low, high)
    else:  # uniform in log space: each decade is as likely as any other
        x = math.exp(rng.uniform(math.log(low), math.log(high)))
    # Four significant digits keep trial names and launch commands readable.
    return min(max(float(f"{x:.4g}"), low), high)


def sample_space(space: Mapping[str, Mapping], num_trials: int, seed: int) -> list[dict]:
    """`num_trials` draws from `space`, the same for the same `seed`; draw i does not depend on
    `num_trials`, so raising it later keeps the trials already run."""
    rng = random.Random(seed)
    return [{key: _draw(rng, key, spec) for key, spec in space.items()} for _ in range(num_trials)]


def _label(value) -> str:
    if isinstance(value, list | tuple):
        return "-".join(_label(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _trial_name(prefix: str, values: dict, seed: int | None) -> str:
    """`learning_rate=0.003,seed=0`: last key names, the full key where two share one."""
    leaves = [key.rsplit(".", 1)[-1] for key in values]
    parts = [prefix] if prefix else []
    for (key, value), leaf in zip(values.items(), leaves, strict=True):
        parts.append(f"{leaf if leaves.count(leaf) == 1 else key}={_label(value)}")
    if seed is not None:
        parts.append(f"seed={seed}")
    name = re.sub(r"[^A-Za-z0-9_.,=+-]", "_", ",".join(parts)) or "trial"
    if len(name) > 120:  # directory names stop at 255 bytes
        name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return name


def expand(sweep: dict) -> list[Trial]:
    """The trials of a `load_sweep` result: each value combination once per seed."""
    if sweep["search"] == "grid":
        combos = grid_values(sweep["grid"])
        prefixes = [""] * len(combos)
    else:  # random draws may repeat a combination; the index keeps their names apart
        combos = sample_space(sweep["space"], sweep["num_trials"], sweep["random_seed"])
        prefixes = [f"t{i:03d}" for i in range(len(combos))]
    trials = []
    for prefix, values in zip(prefixes, combos, strict=True):
        for seed in sweep["seeds"] or [None]:
            seeds = {} if seed is None else dict.fromkeys(SEED_KEYS, seed)
            overrides = {**sweep["overrides"], **values, **seeds}
            trials.append(Trial(_trial_name(prefix, values, seed), values, seed, overrides))
    names = [t.name for t in trials]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"sweep: two trials would share the directory {name!r}; make the "
                              "varied values differ in more than punctuation")  # fmt: skip
    return trials


def _config_keys(config, prefix: str = "") -> list[str]:
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if isinstance(value, ml_collections.ConfigDict | Mapping):
            keys += _config_keys(value, f"{prefix}{key}.")
    return keys


def _check_keys(sweep: dict, base) -> None:
    """Every key the sweep sets exists in the base config; else the nearest one is named."""
    valid = set(_config_keys(base))
    for field in ("overrides", "grid", "space"):
        for key in sweep[field]:
            if key not in valid:
                raise ConfigError(
                    f"sweep {field}: {key!r} is not a key of {sweep['base']}{_nearest(key, valid)}"
                )
    for key in SEED_KEYS if sweep["seeds"] else ():
        if key not in valid:
            raise ConfigError(
                f"sweep seeds: set {key!r}, which {sweep['base']} does not have; leave `seeds` "
                f"empty and put the seed key it has in the grid{_nearest(key, valid)}"
            )


def _trial_config(base, trial: Trial, spec: str):
    """The base config with the trial's overrides, checked as the driver will build it."""
    config = copy.deepcopy(base)
    for key, value in trial.overrides.items():
        try:
            override(config, {key: value})
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"sweep trial {trial.name}: {key}={value!r} does not fit {spec}: "
                              f"{e}") from None  # fmt: skip
    try:
        method_config(config)
    except ValueError as e:  # ConfigError too
        raise ConfigError(f"sweep trial {trial.name}: {e}") from None
    return config


def _flag_value(value) -> str:
    """The value as `--config.a.b=` reads it back (ml_collections config_flags)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value
    return repr(value)


def launch_command(base: str, trial_dir: str, trial: Trial) -> str:
    """The `posttrain train` command line that runs `trial` on its own (shell-quoted)."""
    flags = [f"--config.{key}={_flag_value(value)}" for key, value in trial.overrides.items()]
    return shlex.join(["posttrain", "train", f"--config={base}", f"--workdir={trial_dir}", *flags])


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):  # none yet, or cut short by a kill
        return None


def _write_json(path: str, record: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)  # a kill never leaves half a record


def _jsonable(value):
    return json.loads(json.dumps(value))


def _run_trial(trial: Trial, config, trial_dir: str, sweep: dict) -> dict:
    """Trains one trial (resuming its checkpoint if any) and writes its `trial.json`."""
    os.makedirs(trial_dir, exist_ok=True)
    path = os.path.join(trial_dir, "trial.json")
    record = {
        "trial": trial.name, "status": "running", "values": trial.values, "seed": trial.seed,
        "base": sweep["base"], "overrides": trial.overrides, "started": time.time(),
    }  # fmt: skip
    _write_json(path, record)
    start = time.perf_counter()
    try:
        summary = run_from_config(config, trial_dir)
        # "preempted": SIGTERM stopped the run after a save; the next sweep run resumes it.
        record["status"] = "finished" if summary["stopped"] == "completed" else summary["stopped"]
        record["final_step"] = summary.get("final_step")
    except Exception as e:  # recorded; the sweep goes on with the next trial
        traceback.print_exc()
        record.update(status="failed", error=f"{type(e).__name__}: {e}")
        record["traceback"] = traceback.format_exc()
    record["seconds"] = round(time.perf_counter() - start, 1)
    history = metric_history(trial_dir, sweep["metric"], sweep["mode"])
    record.update(metric=sweep["metric"], **{k: v for k, v in history.items() if k != "logged"})
    _write_json(path, record)
    return record


def _row(trial: Trial, record: dict, keys: list[str], seed, sweep: dict, trial_dir: str) -> dict:
    metric = sweep["metric"]
    history = metric_history(trial_dir, metric, sweep["mode"])
    if record.get("status") == "finished" and "final" not in history:
        raise ConfigError(
            f"sweep metric: trial {trial.name} logged no {metric!r}; it logged "
            f"{history['logged']}{_nearest(metric, history['logged'])}"
        )
    return {
        "trial": trial.name,
        **{key: trial.values.get(key, "") for key in keys},
        "seed": seed,
        "status": record.get("status", "pending"),
        f"final_{metric}": history.get("final"),
        f"best_{metric}": history.get("best"),
        "best_step": history.get("best_step"),
        "seconds": record.get("seconds"),
        "error": record.get("error", ""),
    }


@contextlib.contextmanager
def _compilation_cache(path: str):
    """Trials that differ only in their seed compile the same programs: a persistent compilation
    cache in the sweep's workdir compiles them once (unless JAX has a cache configured)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir:
        yield
        return
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, not only those over JAX's 1 s default: a small model's step compiles in
    # less, and a sweep repeats it per trial all the same.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()
    try:
        yield
    finally:  # the rest of the process compiles as before
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
        compilation_cache.reset_cache()


def run_sweep(path_or_config, workdir: str, *, dry_run: bool = False) -> list[dict]:
    """Runs (or resumes) a sweep: every trial in turn, then the summary tables.

    Every key and value is checked against the base config before the first trial runs.

    Args:
      path_or_config: a sweep file `configs/sweeps/<name>.py`, or its ConfigDict / dict.
      workdir: the sweep's directory; trial `<name>` trains in `<workdir>/<name>`.
      dry_run: print one `posttrain train` command per trial and run nothing.

    Returns:
      One row per trial (as in `summary.csv`); with `dry_run`, each with its `command`.
    """
    from rich.console import Console
    from rich.markup import escape

    sweep = load_sweep(path_or_config)
    base = load_config_file(sweep["base"])
    base.lock()  # an override never adds a key
    _check_keys(sweep, base)
    trials = expand(sweep)
    configs = [_trial_config(base, trial, sweep["base"]) for trial in trials]
    keys = list(dict.fromkeys(key for trial in trials for key in trial.values))
    dirs = [os.path.join(workdir, trial.name) for trial in trials]
    if dry_run:
        rows = []
        for trial, trial_dir in zip(trials, dirs, strict=True):
            command = launch_command(sweep["base"], trial_dir, trial)
            print(command)
            rows.append({"trial": trial.name, **trial.values, "seed": trial.seed,
                         "status": "dry-run", "command": command})  # fmt: skip
        return rows

    records = [_read_json(os.path.join(d, "trial.json")) for d in dirs]
    for trial, trial_dir, record in zip(trials, dirs, records, strict=True):
        old, new = (record or {}).get("overrides", {}), _jsonable(trial.overrides)
        if record and old != new:
            changed = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
            raise ConfigError(
                f"sweep: {trial_dir} holds a run with other settings ({', '.join(changed)} "
                "changed); use a new --workdir or delete that directory"
            )
    os.makedirs(workdir, exist_ok=True)
    console = Console(highlight=False)
    rows, stopped = [], False
    notes = {"running": "resuming the interrupted run", "failed": "retrying after a failure",
             "preempted": "resuming the preempted run"}  # fmt: skip
    for i, (trial, config, trial_dir) in enumerate(zip(trials, configs, dirs, strict=True)):
        record = records[i] or {}
        head = f"trial {i + 1}/{len(trials)}: {escape(trial.name)}"
        if record.get("status") == "finished":
            console.print(f"{head}: finished earlier, skipped")
        elif stopped:
            record = {**record, "status": "pending"}
        else:
            note = notes.get(record.get("status"))
            console.print(f"[bold]{head}[/bold]" + (f" ({note})" if note else ""))
            with _compilation_cache(os.path.join(workdir, "jax_cache")):
                record = _run_trial(trial, config, trial_dir, sweep)
            stopped = record["status"] == "preempted"  # the machine is going away: stop here
            console.print(f"{head}: {record['status']} in {record['seconds']:.0f}s")
        seed = trial.seed if trial.seed is not None else config.get("train", {}).get("seed")
        rows.append(_row(trial, record, keys, seed, sweep, trial_dir))
    groups = summarize(rows, keys, sweep["metric"], sweep["mode"])
    _write_csv(os.path.join(workdir, "summary.csv"), rows)
    _write_csv(os.path.join(workdir, "combinations.csv"), groups)
    _print_summary(console, rows, groups, keys, sweep)
    console.print(f"wrote {os.path.join(workdir, 'summary.csv')} and combinations.csv")
    return rows
