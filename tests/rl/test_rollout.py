"""Rollouts -> training arrays: prompt + completion rows, masks on completion targets only."""

import numpy as np
import pytest

from posttrain.rl import rollout_batch, split_rows
from posttrain.sampling import Completion


def _completion(ids, logps, finish="stop"):
    return Completion("x", tuple(ids), tuple(logps), finish)


def test_rows_hold_prompt_then_completion_with_aligned_log_probs():
    prompts = [
        {"prompt_ids": [5, 6, 7], "domain_id": 1},
        {"prompt_ids": [9], "domain_id": 0},
    ]
    completions = [
        [_completion([11, 2], [-0.5, -0.1]), _completion([12, 13, 14], [-1, -2, -3], "length")],
        [_completion([2], [-0.2]), _completion([15, 2], [-0.3, -0.4])],
    ]
    rewards = np.array([[1.0, 0.0], [0.5, 0.25]])
    b = rollout_batch(prompts, completions, rewards, groups=3, max_len=8, pad_id=0)
    assert b["tokens"].shape == (6, 8) and b["rewards"].shape == (6,)
    np.testing.assert_array_equal(b["tokens"][1], [5, 6, 7, 12, 13, 14, 0, 0])
    np.testing.assert_array_equal(b["targets"][1], [6, 7, 12, 13, 14, 0, 0, 0])
    # The loss covers exactly the positions whose target is a completion token.
    np.testing.assert_array_equal(b["loss_mask"][1], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(b["sampler_logps"][1], [0, 0, -1, -2, -3, 0, 0, 0])
    np.testing.assert_array_equal(b["targets"][2][b["loss_mask"][2] > 0], [2])
    np.testing.assert_array_equal(b["segment_ids"][3], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["positions"][3][:3], [0, 1, 2])
    np.testing.assert_array_equal(b["rewards"], [1.0, 0.0, 0.5, 0.25, 0, 0])
    np.testing.assert_array_equal(b["lengths"], [2, 3, 1, 2, 0, 0])
    np.testing.assert_array_equal(b["truncated"], [0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(b["domain_ids"], [1, 1, 0, 0, -1, -1])  # the last group: filler
    assert b["loss_mask"][4:].sum() == 0 and b["segment_ids"][4:].sum() == 0

    parts = split_rows(b, 2)
    np.testing.assert_array_equal(parts[0]["rewards"], [1.0, 0.5, 0])
    np.testing.assert_array_equal(parts[1]["lengths"], [3, 2, 0])


def test_too_long_rows_and_groups_raise():
    prompts = [{"prompt_ids": [1, 2, 3], "domain_id": 0}]
    completions = [[_completion([4, 5, 6], [0, 0, 0])]]
    with pytest.raises(ValueError, match="max_len"):
        rollout_batch(prompts, completions, np.zeros((1, 1)), groups=1, max_len=5)
    with pytest.raises(ValueError, match="do not fit"):
        rollout_batch(prompts * 2, completions * 2, np.zeros((2, 1)), groups=1, max_len=8)
