"""Partial rollouts with in-flight weight updates (rollout.partial, decoupled mode)."""

import numpy as np
import pytest

from posttrain.methods import run_from_config
from posttrain.train import read_metrics

from .toy import toy_config


@pytest.mark.parametrize("steps", [4, pytest.param(16, marks=pytest.mark.slow)])  # ~55 s, ~150 s
def test_long_rollouts_continue_on_new_weights_within_the_staleness_bound(tmp_path, devices, steps):
    """32-token completions (4 engine calls of 8 tokens each), weights updated every step: the
    groups that finish first make each batch, the others continue on the newer weights; every
    batch is full (nothing dropped), every token is at most max_staleness versions old, some
    groups span two versions, and (16 steps) the reward rises."""
    config = toy_config(
        train__steps=steps,
        rollout__sampler_devices=4,
        rollout__max_staleness=1,
        rollout__partial=True,
        rollout__max_new_tokens=32,
        loss__correction="token",
        loss__tis_cap=2.0,
    )
    summary = run_from_config(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert summary["final_step"] == steps
    assert all(r["groups"] == 8 and r["groups_dropped"] == 0 for r in rows)
    assert all(0 <= r["token_staleness_max"] <= 1 for r in rows)
    assert all(r["staleness"] == r["token_staleness_max"] for r in rows)
    assert sum(r["groups_spanning_versions"] for r in rows) > 0
    if steps == 16:  # (means of the first and last 4 steps)
        rewards = [r["reward"] for r in rows]
        assert np.mean(rewards[-4:]) > 2 * np.mean(rewards[:4]), rewards
