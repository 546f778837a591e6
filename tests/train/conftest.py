"""A small SFT config on the bundled demo task, and a way to run it in a subprocess."""

import json
import os
import subprocess

from posttrain.config import load_config_file, override
from tests.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = {
    "data.max_len": 64,
    "data.batch_size": 8,
    "train.steps": 12,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.progress": False,
    "checkpoint.every": 4,
    "checkpoint.keep_last": 10,
    "optimizer.warmup_steps": 2,
    "mesh.ici.fsdp": 1,
    "mesh.ici.data": -1,
}


def small_config(**overrides):
    """configs/sft.py:tiny shrunk to seconds; `overrides` use dotted keys with `__` for dots."""
    config = load_config_file(os.path.join(REPO, "configs", "sft.py") + ":tiny")
    config.eval_data = []
    values = {**SMALL, **{k.replace("__", "."): v for k, v in overrides.items()}}
    return override(config, values)


_RUNNER = """
import json, os, sys, time
from tests.train.conftest import small_config
from posttrain.methods import run_from_config
delay = float(os.environ.get("STEP_DELAY", "0"))
config = small_config(**json.loads(sys.argv[2]))
summary = run_from_config(config, sys.argv[1],
                          on_metrics=lambda step, m: time.sleep(delay) if delay else None)
print("STOPPED", summary["stopped"], summary["final_step"], flush=True)
"""


def start_run(workdir, *, step_delay=0.0, **overrides) -> subprocess.Popen:
    """Starts `run_from_config` on the small config in a fresh Python process (8 fake devices,
    tests/launch.py); `step_delay` seconds of sleep after each step's metrics."""
    argv = ["-c", _RUNNER, str(workdir), json.dumps(overrides)]
    return launch(argv, devices=8, env={"STEP_DELAY": str(step_delay)})


def train_losses(workdir) -> list[tuple[int, float]]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [(r["step"], r["loss"]) for r in rows if r["split"] == "train"]
