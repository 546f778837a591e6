"""Data: tokenizers and chat templates (sources, packing and mixtures arrive with SFT)."""

from posttrain.data._tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
