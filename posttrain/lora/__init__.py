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
)
from posttrain.lora._config import DEFAULT_TARGETS, LoRAConfig
from posttrain.lora._peft import save_peft

__all__ = [
    "DEFAULT_TARGETS",
    "LoRAConfig",
    "adapter_kwargs",
    "adapter_shapes",
    "adapter_shardings",
    "adapter_specs",
    "init_adapters",
    "lora_transform",
    "merge",
    "merge_weight",
    "save_peft",
    "target_paths",
]
