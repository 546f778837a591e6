"""Unmerged adapters in HF PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`.

PEFT names a LoRA pair after the module it wraps (`base_model.model.<module>.lora_A.weight`
`[r, in]`, `lora_B.weight` `[out, r]`, both on the HF `[out, in]` layout of the weight), so a
run's adapters load with `PeftModel.from_pretrained(<the base in transformers>, path)`.
"""

from __future__ import annotations

import json
import os
import tempfile

import jax
import numpy as np
from safetensors.numpy import save_file

from posttrain import paths
from posttrain.lora._adapters import _get, delta
from posttrain.lora._config import LoRAConfig
from posttrain.models import ModelConfig, export_layout, weight_table


def _to_host(x: jax.Array) -> np.ndarray:
    """`x` whole on this host (adapters are small: every process joins the gather)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _module(hf_name: str) -> str:
    return hf_name.removesuffix(".weight")


def save_peft(
    model_config: ModelConfig,
    adapters: dict,
    lora: LoRAConfig,
    path: str,
    *,
    base_model: str = "",
) -> None:
    """Writes `adapters` as a PEFT LoRA adapter directory.

    Args:
      model_config: the base model's config.
      adapters: the adapter params (`init_adapters`, a LoRA run's checkpoint).
      lora: their config (rank, alpha).
      path: output directory (created).
      base_model: recorded as `base_model_name_or_path`.

    Raises:
      ValueError: a target whose HF layout is not a plain `[out, in]` view of ours (e.g. MLA
        checkpoints with interleaved rope dims); export it merged instead.
    """
    if "vision" in adapters:
        raise ValueError(
            "adapters on the vision encoder have no PEFT export here yet; export merged "
            "(--merge-lora)"
        )
    entries = {e.path: e for e in weight_table(model_config, export_layout(model_config))}
    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    for stack, tree in adapters.items():
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for keys, _ in flat:
            if keys[-1].key != "a":
                continue
            where = (stack, *(k.key for k in keys[:-1]))
            entry = entries[where]
            a, b = (_to_host(x) for x in (_get(tree, where[1:])[n] for n in ("a", "b")))
            for index, name in entry.pieces(a.shape):
                a_i, b_i = a[index], b[index]
                r = a_i.shape[0]
                lora_a = a_i.reshape(r, -1)  # [r, in]
                lora_b = b_i.reshape(r, -1).T  # [out, r]
                if not modules or index == (0,) * len(index):
                    want = entry.to_hf(np.asarray(delta(a_i, b_i, 0)))
                    if want.shape != (lora_b.shape[0], lora_a.shape[1]) or not np.allclose(
                        want, lora_b @ lora_a, rtol=1e-4, atol=1e-6
                    ):
                        raise ValueError(
                            f"{'/'.join(where)}: its HF layout is not a plain view of ours, so "
                            "PEFT's A/B cannot express it; export merged (--merge-lora)"
                        )
                module = _module(name)
                modules.add(module)
                prefix = f"base_model.model.{module}"
                tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(lora_a, np.float32)
                tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(lora_b, np.float32)
    if jax.process_index() != 0:
        return
    # Short names ("q_proj") when they pick exactly the adapted modules, else full names.
    every = {
        _module(name)
        for e in entries.values()
        for _, name in e.pieces(_param_shape(model_config, e.path))
    }
    short = {m.rsplit(".", 1)[-1] for m in modules}
    exact = {m for m in every if m.rsplit(".", 1)[-1] in short} == modules
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(short if exact else modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    if paths.is_remote(path):  # safetensors writes local files: stage, then upload
        with tempfile.TemporaryDirectory(prefix="posttrain-peft-") as local:
            _write_peft(tensors, config, local)
            paths.upload(local, path)
        return
    _write_peft(tensors, config, path)


def _write_peft(tensors: dict, config: dict, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _param_shape(model_config: ModelConfig, path: tuple[str, ...]) -> tuple[int, ...]:
    from posttrain.models import param_specs

    return _get(param_specs(model_config), path).shape
