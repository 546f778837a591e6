"""Data: tokenizers, chat templates, SFT sources, formats, mixtures, packing; preference pairs."""

from posttrain.data._pipeline import DataConfig, SFTData, make_pipeline
from posttrain.data._preference import PairError, encode_pair
from posttrain.data._preference_data import (
    PreferenceData,
    make_preference_pipeline,
    preference_batches,
)
from posttrain.data._sources import SourceConfig
from posttrain.data._tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataConfig",
    "PairError",
    "PreferenceData",
    "SFTData",
    "SourceConfig",
    "Tokenizer",
    "encode_pair",
    "load_tokenizer",
    "make_pipeline",
    "make_preference_pipeline",
    "preference_batches",
]
