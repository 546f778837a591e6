"""Sampling: the KV-cache generation engine used by RL rollouts, eval and `generate`."""

from posttrain.sampling._continuous import generate_continuous
from posttrain.sampling._generate import Completion, check_settings, generate
from posttrain.sampling._run import run_generate
from posttrain.sampling._sample import filter_logits, sample_tokens
from posttrain.sampling._serve import ServeConfig, serve
from posttrain.sampling._speculative import DraftModel, PromptLookup, generate_speculative

__all__ = [
    "check_settings",
    "Completion",
    "DraftModel",
    "filter_logits",
    "generate",
    "generate_continuous",
    "generate_speculative",
    "PromptLookup",
    "run_generate",
    "sample_tokens",
    "serve",
    "ServeConfig",
]
