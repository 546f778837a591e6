"""Sampling: the paged generation engine (RL rollouts, `serve`), the static sampler (the
reference; eval and `generate`), speculative decoding and the OpenAI-compatible server."""

from posttrain.sampling._continuous import (
    generate_continuous,
    generate_speculative,
    request_completions,
)
from posttrain.sampling._engine import Engine, EngineConfig, EngineStats, Request
from posttrain.sampling._generate import Completion, check_settings, generate
from posttrain.sampling._run import default_out, run_generate
from posttrain.sampling._sample import filter_logits, sample_tokens
from posttrain.sampling._serve import ServeConfig, serve
from posttrain.sampling._speculative import MTP, DraftModel, PromptLookup

__all__ = [
    "check_settings",
    "Completion",
    "DraftModel",
    "MTP",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "filter_logits",
    "generate",
    "generate_continuous",
    "generate_speculative",
    "PromptLookup",
    "Request",
    "request_completions",
    "run_generate",
    "default_out",
    "sample_tokens",
    "serve",
    "ServeConfig",
]
