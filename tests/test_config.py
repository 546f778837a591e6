"""Building config dataclasses from config sections: nested sections keep their field's
defaults, a key that moved into a section is named, bad values name their section."""

import pytest

from posttrain.config import ConfigError, build
from posttrain.curate import SampleConfig
from posttrain.eval import TargetTask
from posttrain.rl import RolloutConfig
from posttrain.sampling import SamplingParams


def test_a_section_given_in_part_keeps_its_fields_default_for_the_rest():
    # RL samples at temperature 1 by default; SamplingParams' own default is greedy (0).
    rollout = build(RolloutConfig, {"sampling": {"top_p": 0.9}}, "rollout")
    assert rollout.sampling == SamplingParams(temperature=1.0, top_p=0.9, top_k=0)
    assert build(RolloutConfig, {}, "rollout").sampling == SamplingParams(temperature=1.0)
    pairs = build(SampleConfig, {"sampling": {"top_k": 5}}, "pairs")
    assert pairs.sampling == SamplingParams(temperature=1.0, top_k=5)


def test_a_key_that_moved_into_a_section_is_named():
    with pytest.raises(ConfigError, match=r"did you mean rollout\.sampling\.temperature\?"):
        build(RolloutConfig, {"temperature": 0.7}, "rollout")


@pytest.mark.parametrize(
    "section, message",
    [
        ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
    ],
)
def test_sampling_out_of_range_names_its_section(section, message):
    with pytest.raises(ConfigError, match=rf"rollout\.sampling: {message}"):
        build(RolloutConfig, {"sampling": section}, "rollout")


def test_pass_at_k_needs_sampled_answers():
    with pytest.raises(ConfigError, match="pass@k samples need temperature > 0"):
        build(TargetTask, {"name": "t", "path": "x.jsonl", "num_samples": 4,
                           "sampling": {"temperature": 0.0}}, "target.t")  # fmt: skip
