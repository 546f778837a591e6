"""The HF format's names: the model types we read and write (their architectures and
aliases), and reading a model directory's JSON (`HFFormatError` when it cannot load)."""

from __future__ import annotations

import json

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models._hf_gemma import GEMMA_TYPES
from posttrain.models._hf_vlm import VLM_TYPES

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", *GEMMA_TYPES, *VLM_TYPES,
)  # fmt: skip
_ARCHITECTURES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Kimi K2 is DeepSeek-V3's architecture under its own name (its config.json says so).
_ALIASES = {"kimi_k2": "deepseek_v3"}


class HFFormatError(UserError, ValueError):
    """A model directory that cannot be loaded; the message says which file and what to change."""


def read_json(path: str) -> dict:
    try:
        return json.loads(paths.path(path).read_text())
    except FileNotFoundError:
        raise HFFormatError(f"{path} is missing; a Hugging Face model directory needs it") from None
    except json.JSONDecodeError as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None
