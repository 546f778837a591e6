"""Test helpers that ship with the library: tiny random HF models built on the fly (the `dev`
extra: torch, transformers; nothing here downloads anything), and a decoder written in Flax
NNX as a user would write one (`nnx_decoder`, for "bring your own Flax model").
"""

from posttrain.testing._hf_models import (
    HF_ARCHS,
    HF_VLMS,
    IMAGE_TOKEN,
    hf_logits,
    hf_vlm_logits,
    save_tiny_hf_model,
    save_tiny_hf_vlm,
)
from posttrain.testing._nnx_decoder import Decoder, nnx_decoder

__all__ = [
    "Decoder",
    "HF_ARCHS",
    "HF_VLMS",
    "IMAGE_TOKEN",
    "hf_logits",
    "hf_vlm_logits",
    "nnx_decoder",
    "save_tiny_hf_model",
    "save_tiny_hf_vlm",
]
