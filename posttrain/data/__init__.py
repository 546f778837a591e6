"""Data: tokenizers, chat templates, SFT sources, formats, mixtures, packing, curricula;
preference pairs; tool schemas and tool-call parsing; the data tools (`posttrain data`)."""

from posttrain.data._build import build as build_dataset
from posttrain.data._build import diff as diff_builds
from posttrain.data._build import verify as verify_build
from posttrain.data._clean import CleanConfig, clean
from posttrain.data._curriculum import Phase
from posttrain.data._decontam import DecontamConfig, decontaminate
from posttrain.data._dedup import DedupConfig, dedup
from posttrain.data._images import ImageError, image_array, load_image, preprocess_images
from posttrain.data._io import RecordWriter, read_records
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
from posttrain.data._stratify import stratify, stratify_records
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
    "CleanConfig",
    "DecontamConfig",
    "DedupConfig",
    "LONG_CONTEXT_KINDS",
    "TOOL_FORMATS",
    "DataConfig",
    "ImageError",
    "PairError",
    "ParsedTurn",
    "Phase",
    "RecordWriter",
    "PreferenceData",
    "SFTData",
    "SourceConfig",
    "Tokenizer",
    "build_dataset",
    "clean",
    "decontaminate",
    "dedup",
    "diff_builds",
    "encode_pair",
    "image_array",
    "load_image",
    "long_context_records",
    "load_tokenizer",
    "make_pipeline",
    "make_preference_pipeline",
    "parse_tool_calls",
    "preference_batches",
    "preprocess_images",
    "read_paragraphs",
    "read_records",
    "register_tool_format",
    "stratify",
    "stratify_records",
    "tool_format_for",
    "tool_schema",
    "verify_build",
]
