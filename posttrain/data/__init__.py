"""Data: tokenizers, chat templates, SFT sources, formats, mixtures, packing; preference pairs;
tool schemas and tool-call parsing."""

from posttrain.data._long_context import KINDS as LONG_CONTEXT_KINDS
from posttrain.data._long_context import long_context_records, read_paragraphs
from posttrain.data._pipeline import DataConfig, SFTData, make_pipeline
from posttrain.data._preference import PairError, encode_pair
from posttrain.data._preference_data import (
    PreferenceData,
    make_preference_pipeline,
    preference_batches,
)
from posttrain.data._sources import SourceConfig
from posttrain.data._tokenizer import Tokenizer, load_tokenizer
from posttrain.data._tools import (
    TOOL_FORMATS,
    ParsedTurn,
    parse_tool_calls,
    register_tool_format,
    tool_format_for,
    tool_schema,
)

__all__ = [
    "LONG_CONTEXT_KINDS",
    "TOOL_FORMATS",
    "DataConfig",
    "PairError",
    "ParsedTurn",
    "PreferenceData",
    "SFTData",
    "SourceConfig",
    "Tokenizer",
    "encode_pair",
    "long_context_records",
    "load_tokenizer",
    "make_pipeline",
    "make_preference_pipeline",
    "parse_tool_calls",
    "preference_batches",
    "read_paragraphs",
    "register_tool_format",
    "tool_format_for",
    "tool_schema",
]
