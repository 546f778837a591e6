"""Models: one decoder-only transformer, its presets and HF import/export."""

from posttrain.models._attention import attention, attention_mask
from posttrain.models._cache import KV_DTYPES, KVCache, PagedKVCache
from posttrain.models._config import ModelConfig, NNXSpec, RopeScaling, VisionConfig
from posttrain.models._hf import check_export_destination, from_hf, mtp_from_hf, to_hf
from posttrain.models._hf_config import HFFormatError, load_hf_config
from posttrain.models._invariant import token_logprobs
from posttrain.models._mtp import MTPModule
from posttrain.models._nnx import (
    NNXCache,
    has_hidden_states,
    module_of,
    nnx_describe,
    require_kv_cache,
)
from posttrain.models._ops import ParamSpec
from posttrain.models._params import (
    init_params,
    num_params,
    param_axes,
    param_shapes,
    param_shardings,
    param_specs,
    split_layers,
    unstack_layers,
)
from posttrain.models._pipeline import bubble_fraction
from posttrain.models._presets import PRESETS, get_preset
from posttrain.models._safetensors import STATS as hf_read_stats
from posttrain.models._transformer import (
    Transformer,
    forward,
    hidden_states,
    init_cache,
    lm_logits,
)

__all__ = [
    "KVCache",
    "KV_DTYPES",
    "PagedKVCache",
    "HFFormatError",
    "PRESETS",
    "MTPModule",
    "ModelConfig",
    "VisionConfig",
    "NNXCache",
    "NNXSpec",
    "ParamSpec",
    "RopeScaling",
    "Transformer",
    "attention",
    "attention_mask",
    "bubble_fraction",
    "check_export_destination",
    "forward",
    "from_hf",
    "get_preset",
    "has_hidden_states",
    "hf_read_stats",
    "hidden_states",
    "init_cache",
    "init_params",
    "lm_logits",
    "module_of",
    "mtp_from_hf",
    "nnx_describe",
    "num_params",
    "load_hf_config",
    "param_axes",
    "param_shapes",
    "param_shardings",
    "param_specs",
    "require_kv_cache",
    "split_layers",
    "token_logprobs",
    "unstack_layers",
    "to_hf",
]
