"""Sampling: the KV-cache generation engine used by RL rollouts, eval and `generate`."""

from posttrain.sampling._continuous import generate_continuous
from posttrain.sampling._generate import Completion, check_settings, generate
from posttrain.sampling._run import run_generate
from posttrain.sampling._sample import filter_logits, sample_tokens

__all__ = [
    "check_settings",
    "Completion",
    "filter_logits",
    "generate",
    "generate_continuous",
    "run_generate",
    "sample_tokens",
]
