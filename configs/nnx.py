"""Bring your own Flax model: a Gemma-style decoder written in Flax NNX (posttrain.testing's
`nnx_decoder`, no posttrain model code inside) trained by every method on the demo's task.

    posttrain train --config=configs/nnx.py:sft --workdir=runs/nnx/sft     # CPU, ~2 minutes
    make demo                                   # (once: the demo's preference pairs for dpo)
    posttrain train --config=configs/nnx.py:dpo --workdir=runs/nnx/dpo
    posttrain train --config=configs/nnx.py:grpo --workdir=runs/nnx/grpo

Presets:
  sft   the module from its own random init, supervised on the bundled arithmetic problems.
  dpo   DPO from runs/nnx/sft on the demo's right-vs-wrong answer pairs.
  grpo  GRPO from runs/nnx/sft with the arithmetic verifier; rollouts on the paged engine.
Your own module: set model.nnx to its builder ("package.module:function", called with
`rngs=nnx.Rngs(...)` and model.nnx_kwargs) and keep the rest; LoRA: --config.lora.enabled=True
with lora.targets matching your weights' paths ("layers/0/attn/q" here).
"""

import os

from posttrain.config import load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))

# Gemma's recipe at the tiny preset's size: one key/value head (multi-query attention), GELU
# gates, (1 + w) norms, sqrt(D)-scaled tied embeddings, soft-capped logits.
GEMMA_TINY = {
    "style": "gemma",
    "vocab_size": 512,  # the demo tokenizer's
    "embed_dim": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 16,
    "mlp_dim": 128,
    "max_seq_len": 512,
}
# Every layer's attention and MLP weights: the paths look like "layers/1/mlp/gate".
TARGETS = ["attn/(q|k|v|o)$", "mlp/(gate|up|down)$"]


def get_config(preset: str = "sft"):
    files = {"sft": "sft.py:tiny", "dpo": "dpo.py:tiny", "grpo": "grpo.py:tiny"}
    if preset not in files:
        raise ValueError(f"unknown nnx preset {preset!r}: {', '.join(files)}")
    c = load_config_file(os.path.join(_HERE, files[preset]))
    c.model.nnx = "posttrain.testing:nnx_decoder"
    c.model.nnx_kwargs = GEMMA_TINY
    c.model.remat = ""  # (a setting of posttrain's own decoder)
    c.model.checkpoint = "" if preset == "sft" else os.path.join("runs", "nnx", "sft")
    c.lora.targets = TARGETS
    if preset == "sft":
        c.train.steps = 600
    return c
