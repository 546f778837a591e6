"""Models: one decoder-only transformer, its presets and HF import/export."""

from posttrain.models._attention import attention, attention_mask
from posttrain.models._cache import KV_DTYPES, KVCache, PagedKVCache
from posttrain.models._components import MoEConfig, RopeScaling, VisionConfig
from posttrain.models._config import ModelConfig, NNXSpec
from posttrain.models._hf import check_export_destination, from_hf, mtp_from_hf, to_hf
from posttrain.models._hf_config import load_hf_config
from posttrain.models._hf_format import HFFormatError
from posttrain.models._hf_layout import export_layout
from posttrain.models._hf_table import weight_table
from posttrain.models._invariant import token_logprobs
from posttrain.models._moe import expert_parallelism, update_routing_bias
from posttrain.models._mtp import MTPModule
from posttrain.models._nnx import (
    NNXCache,
    has_hidden_states,
    module_of,
    nnx_describe,
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
from posttrain.models._pipeline import bubble_fraction, loss_row_groups
from posttrain.models._presets import PRESETS, get_preset
from posttrain.models._safetensors import STATS as hf_read_stats
from posttrain.models._staged_export import staged_export
from posttrain.models._transformer import (
    Transformer,
    forward,
    hidden_states,
    init_cache,
    lm_logits,
)
from posttrain.models._workdir import (
    ModelSpec,
    checkpoint_items,
    checkpoint_json,
    finished_step,
    model_params,
    on_default_device,
    restore_params,
    with_shardings,
)

__all__ = [
    "KVCache",
    "KV_DTYPES",
    "PagedKVCache",
    "HFFormatError",
    "PRESETS",
    "MTPModule",
    "ModelConfig",
    "MoEConfig",
    "ModelSpec",
    "VisionConfig",
    "NNXCache",
    "NNXSpec",
    "ParamSpec",
    "RopeScaling",
    "Transformer",
    "attention",
    "attention_mask",
    "bubble_fraction",
    "loss_row_groups",
    "check_export_destination",
    "expert_parallelism",
    "finished_step",
    "export_layout",
    "checkpoint_items",
    "checkpoint_json",
    "forward",
    "from_hf",
    "get_preset",
    "has_hidden_states",
    "hf_read_stats",
    "hidden_states",
    "init_cache",
    "init_params",
    "lm_logits",
    "model_params",
    "module_of",
    "mtp_from_hf",
    "nnx_describe",
    "num_params",
    "on_default_device",
    "load_hf_config",
    "param_axes",
    "param_shapes",
    "param_shardings",
    "param_specs",
    "restore_params",
    "split_layers",
    "staged_export",
    "token_logprobs",
    "unstack_layers",
    "update_routing_bias",
    "weight_table",
    "with_shardings",
    "to_hf",
]
