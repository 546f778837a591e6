"""Config-driven sweeps: expansion, validation, dry-run, resuming, and a real 2x2 SFT sweep."""

import csv
import json
import math
import os
import shlex
import shutil

import jax
import pytest

from posttrain.cli._flags import config_flag, parse
from posttrain.cli.sweep import main as sweep_cli
from posttrain.config import ConfigError
from posttrain.errors import UserError
from posttrain.methods import _sweep as sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "sft.py") + ":tiny"
LRS = [3e-3, 3e-4]

# configs/sft.py:tiny shrunk to seconds per trial.
FAST = {
    "data.max_len": 64,
    "data.batch_size": 8,
    "train.steps": 20,
    "train.log_every": 5,
    "train.eval_every": 10,
    "train.eval_batches": 2,
    "train.progress": False,
    "checkpoint.every": 10,
    "optimizer.warmup_steps": 2,
    "mesh.ici.fsdp": 1,
    "mesh.ici.data": -1,
}


def lr_seeds(**fields) -> dict:
    return {
        "base": TINY,
        "overrides": FAST,
        "grid": {"optimizer.learning_rate": LRS},
        "seeds": [0, 1],
        "metric": "eval_loss",
        **fields,
    }


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def fake_train(monkeypatch):
    """Replaces training by a run that logs eval_loss = 1000 * lr + seed at step 2."""
    calls = []

    def run(config, workdir, **kwargs):
        calls.append(os.path.basename(workdir))
        if calls[-1] in fake_train_fails:
            raise RuntimeError("boom")
        lr, seed = config.optimizer.learning_rate, config.train.seed
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
            for step, loss in [(1, 50.0), (2, 1000 * lr + seed)]:
                f.write(json.dumps({"step": step, "split": "eval", "eval_loss": loss}) + "\n")
        return {"stopped": "completed", "final_step": 2}

    fake_train_fails = set()
    monkeypatch.setattr(sweep, "run_from_config", run)
    return calls, fake_train_fails


def test_grid_values_are_the_product_last_key_fastest():
    combos = sweep.grid_values({"a.x": [1, 2], "b.y": ["p", "q", "r"]})
    assert len(combos) == 6
    assert combos[:3] == [{"a.x": 1, "b.y": "p"}, {"a.x": 1, "b.y": "q"}, {"a.x": 1, "b.y": "r"}]
    with pytest.raises(ConfigError, match="lists a value twice"):
        sweep.grid_values({"a.x": [1, 1]})
    with pytest.raises(ConfigError, match="non-empty list"):
        sweep.grid_values({"a.x": 3})


def test_trial_names_are_deterministic_and_path_safe():
    spec = sweep.load_sweep(lr_seeds())
    names = [t.name for t in sweep.expand(spec)]
    assert names == [
        "learning_rate=0.003,seed=0",
        "learning_rate=0.003,seed=1",
        "learning_rate=0.0003,seed=0",
        "learning_rate=0.0003,seed=1",
    ]
    trial = sweep.expand(spec)[1]
    assert trial.overrides == {
        **FAST, "optimizer.learning_rate": 3e-3, "train.seed": 1, "data.seed": 1
    }  # fmt: skip
    # Two keys ending in the same name keep their full keys; "/" never makes a subdirectory.
    spec = sweep.load_sweep(
        {"base": TINY, "grid": {"train.seed": [1], "data.seed": [2], "model.hf_path": ["a/b"]}}
    )
    assert [t.name for t in sweep.expand(spec)] == ["train.seed=1,data.seed=2,hf_path=a_b"]


def test_nested_and_dotted_keys_are_the_same_sweep():
    nested = sweep.load_sweep(
        {"base": TINY, "overrides": {"train": {"steps": 5}}, "grid": {"optimizer": {"b1": [0.9]}}}
    )
    assert nested["overrides"] == {"train.steps": 5}
    assert nested["grid"] == {"optimizer.b1": [0.9]}


def test_random_search_is_reproducible_and_respects_bounds():
    space = {
        "optimizer.learning_rate": {"log_uniform": [1e-4, 1e-1]},
        "optimizer.b1": {"uniform": [0.8, 0.95]},
        "train.micro_batches": {"int": [1, 3]},
        "optimizer.schedule": {"values": ["cosine", "linear"]},
    }
    draws = sweep.sample_space(space, 3000, seed=7)
    assert draws == sweep.sample_space(space, 3000, seed=7)
    assert draws != sweep.sample_space(space, 3000, seed=8)
    assert draws[:5] == sweep.sample_space(space, 5, seed=7)  # more trials keep the first ones
    lrs = [d["optimizer.learning_rate"] for d in draws]
    assert all(1e-4 <= x <= 1e-1 for x in lrs)
    # Uniform in log space: each of the three decades gets about a third of the draws (uniform
    # in linear space would put 90% in the top one).
    for low in (1e-4, 1e-3, 1e-2):
        share = sum(low <= x < 10 * low for x in lrs) / len(lrs)
        assert 0.28 < share < 0.39, (low, share)
    b1 = [d["optimizer.b1"] for d in draws]
    assert all(0.8 <= x <= 0.95 for x in b1) and 0.85 < sum(b1) / len(b1) < 0.9
    assert {d["train.micro_batches"] for d in draws} == {1, 2, 3}
    assert {d["optimizer.schedule"] for d in draws} == {"cosine", "linear"}


def test_random_search_trials_and_bad_spaces():
    spec = sweep.load_sweep(
        {
            "base": TINY,
            "search": "random",
            "space": {"optimizer.learning_rate": {"log_uniform": [1e-4, 1e-2]}},
            "num_trials": 3,
            "seeds": [0, 1],
            "random_seed": 3,
        }
    )
    trials = sweep.expand(spec)
    assert len(trials) == 6 and trials[0].name.startswith("t000,learning_rate=")
    assert trials[0].values == trials[1].values and trials[0].seed != trials[1].seed
    for space, message in [
        ({"values": [1], "int": [1, 2]}, "expected one of"),
        ({"uniform": [2.0, 1.0]}, "low <= high"),
        ({"log_uniform": [0.0, 1.0]}, "0 < low"),
        ({"int": [1.5, 3]}, "must be ints"),
        ({"values": []}, "non-empty list"),
    ]:
        with pytest.raises(ConfigError, match=message):
            sweep.sample_space({"optimizer.b1": space}, 1, seed=0)


def test_unknown_keys_and_bad_values_fail_before_any_trial(tmp_path, fake_train):
    calls, _ = fake_train
    lr = "nearest valid key: 'optimizer.learning_rate'"
    cases = [
        (lr_seeds(grid={"optimizer.learning_rat": LRS}), lr),
        (lr_seeds(grid={"train.learning_rate": LRS}), lr),  # same last name: the nearest
        (lr_seeds(overrides={**FAST, "train.step": 3}), "nearest valid key: 'train.steps'"),
        (lr_seeds(seed=[0]), "unknown field 'seed' \\(nearest valid key: 'seeds'\\)"),
        (lr_seeds(overrides={**FAST, "train.steps": "ten"}), "train.steps='ten' does not fit"),
        (lr_seeds(overrides={**FAST, "optimizer.warmup_steps": -1}), "warmup"),
        (lr_seeds(overrides={**FAST, "train.seed": 3}), "both in overrides and varied"),
        (lr_seeds(search="random"), "grid: not used by search='random'"),
        (lr_seeds(search="random", grid={}), "needs a `space`"),
    ]  # fmt: skip
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message):
            sweep.run_sweep(spec, str(tmp_path / "sweep"))
    assert calls == [] and not os.path.exists(tmp_path / "sweep")


def test_dry_run_prints_one_reproducing_command_per_trial(tmp_path, capsys):
    workdir = str(tmp_path / "sweep")
    rows = sweep.run_sweep(lr_seeds(), workdir, dry_run=True)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and [r["command"] for r in rows] == lines
    assert not os.path.exists(workdir)
    for line, trial in zip(lines, sweep.expand(sweep.load_sweep(lr_seeds())), strict=True):
        args = shlex.split(line)
        assert args[:3] == ["posttrain", "train", f"--config={TINY}"]
        assert args[3] == f"--workdir={os.path.join(workdir, trial.name)}"
        argv = ["posttrain train", *args[2:]]

        def define(flags, fv, argv=argv):
            config_flag(fv, argv)
            flags.DEFINE_string("workdir", None, "", flag_values=fv)

        config = parse(argv, define).config  # `posttrain train` reads the same config back
        for key, value in trial.overrides.items():
            node = config
            for name in key.split("."):
                node = node[name]
            assert node == value, key


def test_cli_dry_run_of_the_bundled_sweep_and_help(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the sweep file names its base relative to the repository
    config = "--config=configs/sweeps/sft_lr_seeds.py"
    assert sweep_cli(["posttrain sweep", config, f"--workdir={tmp_path}/s", "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("posttrain train --config=") for line in lines)
    assert "--config.train.steps=60" in lines[0] and "--config.train.seed=1" in lines[1]
    with pytest.raises(SystemExit) as exit_:
        sweep_cli(["--help"])
    assert exit_.value.code == 0 and "examples:" in capsys.readouterr().out
    with pytest.raises(UserError, match="--workdir=DIR are required"):
        sweep_cli(["posttrain sweep", config])


def test_summary_failures_and_retry_with_a_fake_trainer(tmp_path, fake_train, capsys):
    calls, fails = fake_train
    workdir = str(tmp_path / "sweep")
    fails.add("learning_rate=0.0003,seed=1")
    rows = sweep.run_sweep(lr_seeds(), workdir)
    assert [r["status"] for r in rows] == ["finished", "finished", "finished", "failed"]
    assert rows[3]["error"] == "RuntimeError: boom" and len(calls) == 4  # the sweep went on
    record = json.load(open(os.path.join(workdir, rows[3]["trial"], "trial.json")))
    assert record["status"] == "failed" and "RuntimeError: boom" in record["traceback"]
    record = json.load(open(os.path.join(workdir, rows[0]["trial"], "trial.json")))
    assert record["status"] == "finished" and record["values"] == {"optimizer.learning_rate": 3e-3}
    assert (record["final"], record["best"], record["best_step"]) == (3.0, 3.0, 2)

    fails.clear()
    capsys.readouterr()
    rows = sweep.run_sweep(lr_seeds(), workdir)
    out = capsys.readouterr().out
    assert calls[4:] == ["learning_rate=0.0003,seed=1"]  # only the failed trial ran again
    assert "retrying after a failure" in out and out.count("finished earlier, skipped") == 3
    assert [r["status"] for r in rows] == ["finished"] * 4
    combos = read_csv(os.path.join(workdir, "combinations.csv"))
    assert [c["optimizer.learning_rate"] for c in combos] == ["0.0003", "0.003"]  # lower first
    assert float(combos[0]["mean_final_eval_loss"]) == pytest.approx(0.8)  # 0.3 and 1.3
    assert float(combos[0]["std_final_eval_loss"]) == pytest.approx(math.sqrt(0.5))
    assert "best: optimizer.learning_rate=0.0003" in out

    rows = sweep.run_sweep(lr_seeds(mode="max"), workdir)  # re-ranks, no training
    assert len(calls) == 5
    assert read_csv(os.path.join(workdir, "combinations.csv"))[0]["optimizer.learning_rate"] == (
        "0.003"
    )
    assert rows[0]["best_eval_loss"] == 50.0 and rows[0]["best_step"] == 1
    with pytest.raises(ConfigError, match="logged no 'eval_los'.*nearest valid key: 'eval_loss'"):
        sweep.run_sweep(lr_seeds(metric="eval_los"), workdir)
    with pytest.raises(
        ConfigError, match="holds a run with other settings \\(train.steps changed\\)"
    ):
        sweep.run_sweep(lr_seeds(overrides={**FAST, "train.steps": 30}), workdir)


def test_sweep_of_two_learning_rates_and_two_seeds(tmp_path, capsys):
    """The acceptance: a real 2 x 2 SFT sweep, its table, and a re-run that trains only the
    trial that was killed."""
    workdir = str(tmp_path / "sweep")
    cache = jax.config.jax_compilation_cache_dir
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    rows = sweep.run_sweep(lr_seeds(), workdir)
    out = capsys.readouterr().out
    assert "trial 1/4: learning_rate=0.003,seed=0" in out and "trial 4/4" in out
    assert jax.config.jax_compilation_cache_dir == cache  # the sweep's cache is not left on
    assert jax.config.jax_persistent_cache_min_compile_time_secs == min_secs
    # (every program is cached, however fast it compiled: the tests compile at -O0)
    assert cache or os.listdir(os.path.join(workdir, "jax_cache"))

    table = read_csv(os.path.join(workdir, "summary.csv"))
    assert list(table[0]) == [
        "trial", "optimizer.learning_rate", "seed", "status",
        "final_eval_loss", "best_eval_loss", "best_step", "seconds", "error",
    ]  # fmt: skip
    assert [(r["optimizer.learning_rate"], r["seed"], r["status"]) for r in table] == [
        ("0.003", "0", "finished"), ("0.003", "1", "finished"),
        ("0.0003", "0", "finished"), ("0.0003", "1", "finished"),
    ]  # fmt: skip
    for row in table:
        with open(os.path.join(workdir, row["trial"], "metrics.jsonl")) as f:
            evals = [json.loads(line) for line in f if '"eval"' in line]
        assert [e["step"] for e in evals] == [10, 20]
        assert float(row["final_eval_loss"]) == evals[-1]["eval_loss"]
        best = min(evals, key=lambda e: e["eval_loss"])
        assert float(row["best_eval_loss"]) == best["eval_loss"]
        assert int(row["best_step"]) == best["step"]
    assert table[0]["final_eval_loss"] != table[1]["final_eval_loss"]  # the seeds differ
    means = {
        lr: sum(float(r["final_eval_loss"]) for r in table if r["optimizer.learning_rate"] == lr)
        / 2
        for lr in ("0.003", "0.0003")
    }
    best_lr = min(means, key=means.get)
    combos = read_csv(os.path.join(workdir, "combinations.csv"))
    assert combos[0]["optimizer.learning_rate"] == best_lr
    assert float(combos[0]["mean_final_eval_loss"]) == pytest.approx(means[best_lr])
    assert f"best: optimizer.learning_rate={best_lr}" in out

    # Kill the last trial after its step-10 checkpoint: its final checkpoint is gone and its
    # record still says running.
    killed = os.path.join(workdir, table[3]["trial"])
    shutil.rmtree(os.path.join(killed, "checkpoints", "20"))
    record = json.load(open(os.path.join(killed, "trial.json")))
    json.dump({**record, "status": "running"}, open(os.path.join(killed, "trial.json"), "w"))
    kept = [os.path.join(workdir, r["trial"], "metrics.jsonl") for r in table[:3]]
    mtimes = [os.stat(p).st_mtime_ns for p in kept]

    rows = sweep.run_sweep(lr_seeds(), workdir)
    out = capsys.readouterr().out
    assert out.count("finished earlier, skipped") == 3
    assert "trial 4/4: learning_rate=0.0003,seed=1 (resuming the interrupted run)" in out
    assert [os.stat(p).st_mtime_ns for p in kept] == mtimes  # not retrained
    assert [r["status"] for r in rows] == ["finished"] * 4
    with open(os.path.join(killed, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"train"' in line]
    assert steps == [5, 10, 15, 20]  # resumed from step 10, not from scratch
    assert rows[3]["final_eval_loss"] == pytest.approx(float(table[3]["final_eval_loss"]))


def test_a_preempted_trial_stops_the_sweep_and_resumes(tmp_path, fake_train, monkeypatch, capsys):
    calls, _ = fake_train
    fake = sweep.run_from_config

    def preempt_the_second(config, workdir, **kwargs):
        summary = fake(config, workdir)
        return {**summary, "stopped": "preempted"} if len(calls) == 2 else summary

    monkeypatch.setattr(sweep, "run_from_config", preempt_the_second)
    path = tmp_path / "lr_seeds.py"
    path.write_text(
        "import ml_collections\n\n\ndef get_config():\n"
        f"    return ml_collections.ConfigDict({lr_seeds()!r}, allow_dotted_keys=True)\n"
    )
    argv = ["posttrain sweep", f"--config={path}", f"--workdir={tmp_path}/sweep"]
    assert sweep_cli(argv) == 1  # not every trial finished
    rows = read_csv(tmp_path / "sweep" / "summary.csv")
    assert [r["status"] for r in rows] == ["finished", "preempted", "pending", "pending"]
    assert len(calls) == 2

    monkeypatch.setattr(sweep, "run_from_config", fake)
    assert sweep_cli(argv) == 0
    assert "trial 2/4: learning_rate=0.003,seed=1 (resuming the preempted run)" in (
        capsys.readouterr().out
    )
    assert calls[2:] == [r["trial"] for r in rows[1:]]
