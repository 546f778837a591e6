"""The CAD demo: GRPO with the gated reward turns the SFT model's held-out scripts into parts
that have every required feature (slow)."""

import os
import shutil

import pytest

from posttrain.demo import run_cad_demo

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


@pytest.mark.slow
@needs_bwrap
def test_grpo_with_the_gated_reward_builds_every_held_out_part_with_its_features(tmp_path):
    # The demo on half its GRPO budget (20 steps). At 40 steps, on the 2-core EPYC of
    # 2026-12-06 (docs/cad.md): greedy 0 -> 64 of 64 parts built, none missing a feature;
    # sampled reward 0.41 -> 0.91.
    result = run_cad_demo(str(tmp_path), rl_overrides={"train.steps": 20}, renders=4)
    sft, rl = result["sft"], result["rl"]
    assert rl["greedy"]["built"] >= 60, rl  # it learnt to show its part
    assert rl["greedy"]["built_missing_a_feature"] == 0, rl  # the acceptance
    assert rl["sampled"]["reward"] > sft["sampled"]["reward"] + 0.2, (sft, rl)
    for name, value in rl["sampled"].items():  # every component rises, and the parts built
        if name != "built_missing_a_feature":
            assert value > sft["sampled"][name], (name, sft, rl)
    assert os.path.getsize(result["renders"]) > 0
