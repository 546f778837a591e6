"""RL on the shared loop: exact resume after SIGKILL, divergence stop with finite weights."""

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from posttrain.methods import run_from_config
from posttrain.models import init_params
from posttrain.train import TrainingDiverged, load_checkpoint_model, read_metrics
from tests.launch import finish, launch

from .toy import TWO_DOMAIN_REWARDS, toy_config, two_domain_prompts

STEPS = 8
# Wall-clock times: the only metrics a resumed run cannot repeat.
_TIMES = {"generate_s", "reward_s", "wait_s", "prepare_s", "train_s", "step_s", "tokens_per_second"}

_RUNNER = """
import json, os, sys, time
from tests.rl.toy import toy_config
from posttrain.methods import run_from_config
delay = float(os.environ["STEP_DELAY"])
summary = run_from_config(toy_config(**json.loads(sys.argv[2])), sys.argv[1],
                          on_metrics=lambda step, m: time.sleep(delay))
print("STOPPED", summary["stopped"], summary["final_step"], flush=True)
"""


def _start(workdir, overrides, step_delay=0.0) -> subprocess.Popen:
    """A GRPO run on the toy task in a fresh Python process (as `posttrain train` would be)."""
    argv = ["-c", _RUNNER, str(workdir), json.dumps(overrides)]
    return launch(argv, devices=8, env={"STEP_DELAY": str(step_delay)})


def _committed(workdir, step) -> bool:
    return os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))


# ~160 s (three processes); the shared loop's SIGKILL resume is tests/train/test_resume.py.
@pytest.mark.slow
def test_grpo_resumes_bitwise_after_sigkill(tmp_path):
    # The source's whole state is exercised: prompt position, adaptive domain weights and
    # their RNG, the adaptive KL coefficient.
    source = {"path": two_domain_prompts(tmp_path / "prompts.jsonl"), "weight": 1.0,
              "domain": "digits", "format": "auto"}  # fmt: skip
    overrides = {
        "data__sources": [source],
        "rewards__domains": TWO_DOMAIN_REWARDS,
        "domains__adaptive": True,
        "domains__smoothing": 0.5,
        "kl__coef": 0.05,
        "kl__target": 0.001,
        "kl__horizon": 10,
        "train__steps": STEPS,
        "checkpoint__every": 2,
        "checkpoint__keep_last": 10,
    }
    straight = _start(tmp_path / "straight", overrides)
    killed = _start(tmp_path / "killed", overrides, step_delay=0.5)
    deadline = time.time() + 600
    while not _committed(tmp_path / "killed", 4):
        if killed.poll() is not None or time.time() > deadline:
            killed.kill()
            pytest.fail(f"the run ended before it was killed:\n{killed.communicate()[0][-3000:]}")
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not _committed(tmp_path / "killed", STEPS)
    assert f"STOPPED completed {STEPS}" in finish(_start(tmp_path / "killed", overrides))
    assert f"STOPPED completed {STEPS}" in finish(straight)

    a, b = read_metrics(str(tmp_path / "straight")), read_metrics(str(tmp_path / "killed"))
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    strip = lambda r: {k: v for k, v in r.items() if k not in _TIMES}  # noqa: E731
    assert [strip(r) for r in b] == [strip(r) for r in a]  # bitwise: floats compared exactly
    assert len({r["kl_coef"] for r in b}) > 1 and "domain_weight/digits" in b[-1]


# The shared loop's stop after consecutive non-finite steps: tests/train/test_loop.py (default).
@pytest.mark.slow  # ~40 s
def test_nan_learning_rate_stops_with_finite_weights(tmp_path):
    # (an inf or nan learning rate is refused by the config; this one overflows in the update)
    config = toy_config(optimizer__learning_rate=1e38, train__max_bad_steps=2, train__steps=10)
    with pytest.raises(TrainingDiverged, match="2 consecutive steps"):
        run_from_config(config, str(tmp_path))
    saved = [int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit()]
    assert saved == [3]  # bad steps 1 and 2 seen one step late, stopped after dispatching 3
    assert [r["bad_step"] for r in read_metrics(str(tmp_path))] == [1, 1]
    model = load_checkpoint_model(str(tmp_path))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(model.params))
    # Every update was skipped: the weights are still the random init the run started from.
    fresh = init_params(model.config, jax.random.key(0))
    for x, y in zip(jax.tree.leaves(model.params), jax.tree.leaves(fresh), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
