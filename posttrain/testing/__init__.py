"""Test helpers that ship with the library: tiny random HF models built on the fly.

Needs the `dev` extra (torch, transformers); nothing here downloads anything.
"""

from posttrain.testing._hf_models import HF_ARCHS, hf_logits, save_tiny_hf_model

__all__ = ["HF_ARCHS", "hf_logits", "save_tiny_hf_model"]
