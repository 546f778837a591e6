"""Data: tokenizers and chat templates, SFT sources, formats, mixtures and packing (Grain)."""

from posttrain.data._pipeline import DataConfig, SFTData, make_pipeline
from posttrain.data._sources import SourceConfig
from posttrain.data._tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataConfig",
    "SFTData",
    "SourceConfig",
    "Tokenizer",
    "load_tokenizer",
    "make_pipeline",
]
