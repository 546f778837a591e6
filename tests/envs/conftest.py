"""The calculator task's warm-started tiny model, trained once per session and shared by the
tests that need a model which calls tools (GRPO on the calculator, the episode endpoint)."""

import fcntl
import json
import os

import jax
import numpy as np
import pytest

from posttrain.config import build, load_config_file, override
from posttrain.demo._calculator import build_calculator_assets
from posttrain.methods import SFTConfig, run_sft
from posttrain.models import Transformer, get_preset, restore_params
from posttrain.rl import rollout_batch, sequence_log_probs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_STEPS = 120  # enough to learn the call format (60 is not), not to copy every digit reliably
MIXED_STEPS = 600  # configs/agent.py:calculator_sft: copies digits, calls the tool half the time


def load_policy(workdir: str) -> Transformer:
    """The latest params of a run of the tiny model, on the default device."""
    config = get_preset("tiny")
    abstract = jax.eval_shape(lambda: Transformer.init(config, 0).params)
    return Transformer(jax.device_put(restore_params(workdir, abstract)), config)


def assert_trained_as_sampled(model, episodes, *, max_len: int, pad_id: int):
    """`episodes` (one group each) as an RL batch: the trainer's log-probs of the sampled
    tokens equal the sampler's (mean gap < 1e-3), and each row's loss positions are exactly
    its sampled tokens (observation tokens get no loss)."""
    batch = rollout_batch(
        [{"prompt_ids": [], "domain_id": 0}] * len(episodes),
        [[ep] for ep in episodes],
        np.zeros((len(episodes), 1)),
        groups=len(episodes),
        max_len=max_len,
        pad_id=pad_id,
    )
    logps = np.asarray(sequence_log_probs(model.params, model.config, batch))
    mask = batch["loss_mask"] > 0
    assert mask.sum() == sum(sum(ep.mask) for ep in episodes)
    gap = np.abs(logps - batch["sampler_logps"])[mask]
    assert gap.mean() < 1e-3, gap.mean()
    for r, ep in enumerate(episodes):
        start = len(ep.prompt_ids) - 1
        np.testing.assert_array_equal(batch["loss_mask"][r, start : start + len(ep.mask)], ep.mask)
        np.testing.assert_array_equal(
            batch["targets"][r, start : start + len(ep.mask)], ep.token_ids
        )
    return gap


@pytest.fixture(scope="session")
def calculator_sft(tmp_path_factory):
    """{"workdir": the SFT run, "tokenizer", "train", "eval", "sft": asset paths}: trained once
    per test session, whichever xdist worker asks first (the others wait on a lock)."""
    return _once(_session_dir(tmp_path_factory) / "calculator_sft", SFT_STEPS, tool_share=1.0)


@pytest.fixture(scope="session")
def calculator_mixed_sft(tmp_path_factory):
    """The demo's warm start (configs/agent.py:calculator_sft): half its episodes call the tool,
    half answer at once, so it uses the tool about half the time when sampling."""
    root = _session_dir(tmp_path_factory) / "calculator_mixed_sft"
    return _once(root, MIXED_STEPS, tool_share=0.5)


def _session_dir(tmp_path_factory):
    """This test session's directory, common to its xdist workers (each has its own basetemp
    below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _once(root, steps: int, **asset_options) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = root / "result.json"
        if result.exists():
            return json.loads(result.read_text())
        assets = build_calculator_assets(
            root / "assets", n_train=512, n_eval=32, n_sft=1024, **asset_options
        )
        source = {"path": assets["sft"], "weight": 1.0, "domain": "calculator", "format": "auto"}
        values = {
            "tokenizer": assets["tokenizer"],
            "data.sources": [source],
            "train.steps": steps,
            "train.progress": False,
            "checkpoint.every": steps,
            "checkpoint.async_save": False,
        }
        preset = os.path.join(REPO, "configs", "agent.py:calculator_sft")
        config = override(load_config_file(preset), values)
        workdir = str(root / "sft")
        run_sft(build(SFTConfig, {k: v for k, v in config.items() if k != "method"}), workdir)
        out = {"workdir": workdir, **assets}
        result.write_text(json.dumps(out))
        return out
