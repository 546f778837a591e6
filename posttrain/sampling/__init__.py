"""Sampling: one decoder, the paged generation engine (`generate`, `stream`, eval, RL rollouts,
`serve`; Flax NNX modules too, rerun over each row's tokens), speculative decoding and the
OpenAI-compatible server."""

from posttrain.sampling._backend import PRESETS as SERVE_PRESETS
from posttrain.sampling._backend import _Backend as ServeBackend  # (envs.EpisodeServer's base)
from posttrain.sampling._completion import Completion, check_settings
from posttrain.sampling._continuous import (
    generate_continuous,
    generate_speculative,
    request_completions,
)
from posttrain.sampling._engine import Engine, Request
from posttrain.sampling._engine_config import EngineConfig, EngineStats
from posttrain.sampling._generate import generate
from posttrain.sampling._params import SamplingParams
from posttrain.sampling._plans import planned_decode, planned_prefill
from posttrain.sampling._request import Kept
from posttrain.sampling._run import default_out, run_generate
from posttrain.sampling._sample import filter_logits, sample_tokens
from posttrain.sampling._serve import ServeConfig, api_app, serve
from posttrain.sampling._serve_request import _APIError as APIError
from posttrain.sampling._serve_request import _get as request_field
from posttrain.sampling._serve_request import _settings as request_settings
from posttrain.sampling._serve_request import _tools as request_tools
from posttrain.sampling._speculative import MTP, DraftModel, PromptLookup
from posttrain.sampling._stream import stream

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
    "planned_decode",
    "planned_prefill",
    "Kept",
    "Request",
    "request_completions",
    "run_generate",
    "stream",
    "default_out",
    "sample_tokens",
    "SamplingParams",
    "serve",
    "ServeConfig",
    "SERVE_PRESETS",
    "APIError",
    "ServeBackend",
    "api_app",
    "request_field",
    "request_settings",
    "request_tools",
]
