"""LoRA and QLoRA: low-rank adapters as a wrapper around the frozen model.

The model is never edited: adapters (and a quantised base's dequantisation) enter through the
forward pass's `layer_transform`, one layer at a time inside the layer scan.
"""

from posttrain.lora._adapters import (
    adapter_kwargs,
    adapter_shapes,
    adapter_shardings,
    adapter_specs,
    init_adapters,
    lora_transform,
    merge,
    merge_weight,
    target_paths,
    wrap,
)
from posttrain.lora._config import DEFAULT_TARGETS, LoRAConfig
from posttrain.lora._load import (
    load_checkpoint_model,
    load_lora_params,
    load_model_and_tokenizer,
    merge_jit,
    quantize_base,
    saved_base,
    start_params_single,
)
from posttrain.lora._peft import save_peft
from posttrain.lora._policy import Policy
from posttrain.lora._quant import (
    QUANT_FORMATS,
    QuantizedWeight,
    dequantize,
    dequantize_tree,
    param_bytes,
    quantize_params,
    quantized_shapes,
    quantized_shardings,
)

__all__ = [
    "DEFAULT_TARGETS",
    "Policy",
    "QUANT_FORMATS",
    "QuantizedWeight",
    "dequantize",
    "dequantize_tree",
    "param_bytes",
    "quantize_params",
    "quantize_base",
    "quantized_shapes",
    "quantized_shardings",
    "LoRAConfig",
    "adapter_kwargs",
    "adapter_shapes",
    "adapter_shardings",
    "adapter_specs",
    "init_adapters",
    "load_checkpoint_model",
    "load_lora_params",
    "load_model_and_tokenizer",
    "lora_transform",
    "merge",
    "merge_jit",
    "merge_weight",
    "save_peft",
    "saved_base",
    "start_params_single",
    "target_paths",
    "wrap",
]
