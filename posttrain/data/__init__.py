"""Data: tokenizers, chat templates, SFT sources, formats, mixtures, packing, curricula;
preference pairs; tool schemas and tool-call parsing; reading data builds. The offline data
tools (`posttrain data`) are `posttrain.curate`."""

from posttrain.data._accounting import source_names
from posttrain.data._build_check import DIGEST as BUILD_DIGEST
from posttrain.data._build_check import FORMAT as BUILD_FORMAT
from posttrain.data._build_check import HASHES as BUILD_HASHES
from posttrain.data._build_check import MANIFEST as BUILD_MANIFEST
from posttrain.data._build_check import build_id, record_bytes, sha256_file
from posttrain.data._build_check import read_manifest as read_build_manifest
from posttrain.data._build_check import verify as verify_build
from posttrain.data._chat_template import REASONING_FIELDS
from posttrain.data._curriculum import Phase
from posttrain.data._data_config import DataConfig, config_identity
from posttrain.data._formats import (
    TEXT_KEYS,
    ExampleEncoder,
    RecordError,
    decode,
    detect_format,
    encode_prompt,
    encode_record,
    to_example,
)
from posttrain.data._image_chat import (
    ImageRecordError,
    ImageSpec,
    flatten_record,
    has_images,
    image_root,
    image_spec,
    load_pixels,
    pixel_rows,
    prompt_image_spec,
    prompt_pixels,
    prompt_slots,
)
from posttrain.data._images import ImageError, image_array, load_image, preprocess_images
from posttrain.data._io import (
    RecordWriter,
    clear_stale,
    default_mode,
    kind_of,
    read_records,
    staging_name,
)
from posttrain.data._long_context import KINDS as LONG_CONTEXT_KINDS
from posttrain.data._long_context import long_context_records, read_paragraphs
from posttrain.data._mixing import index_mixture
from posttrain.data._pipeline import SFTData, make_pipeline, process_share
from posttrain.data._preference import PairError, encode_pair
from posttrain.data._preference_data import (
    PreferenceData,
    make_preference_pipeline,
    preference_batches,
)
from posttrain.data._retrieval import (
    RetrievalIndex,
    build_index,
    fit_document,
    fit_prompt,
    passages_of,
)
from posttrain.data._sources import Records, SourceConfig, canonical_identity, check_columns
from posttrain.data._tokenizer import Tokenizer, load_tokenizer
from posttrain.data._tools import (
    TOOL_FORMATS,
    ParsedTurn,
    parse_tool_calls,
    register_tool_format,
    tool_format_for,
    tool_schema,
)
from posttrain.data._turns import Turns

__all__ = [
    "BUILD_DIGEST",
    "BUILD_FORMAT",
    "BUILD_HASHES",
    "BUILD_MANIFEST",
    "DataConfig",
    "ExampleEncoder",
    "ImageError",
    "ImageRecordError",
    "ImageSpec",
    "LONG_CONTEXT_KINDS",
    "PairError",
    "ParsedTurn",
    "Phase",
    "PreferenceData",
    "REASONING_FIELDS",
    "RecordError",
    "RecordWriter",
    "Records",
    "SFTData",
    "SourceConfig",
    "check_columns",
    "RetrievalIndex",
    "build_index",
    "fit_document",
    "fit_prompt",
    "passages_of",
    "TEXT_KEYS",
    "TOOL_FORMATS",
    "Tokenizer",
    "Turns",
    "build_id",
    "canonical_identity",
    "clear_stale",
    "config_identity",
    "decode",
    "default_mode",
    "detect_format",
    "encode_pair",
    "encode_prompt",
    "encode_record",
    "flatten_record",
    "has_images",
    "image_array",
    "image_root",
    "image_spec",
    "index_mixture",
    "kind_of",
    "load_image",
    "load_pixels",
    "load_tokenizer",
    "long_context_records",
    "make_pipeline",
    "make_preference_pipeline",
    "parse_tool_calls",
    "pixel_rows",
    "preference_batches",
    "preprocess_images",
    "process_share",
    "prompt_image_spec",
    "prompt_pixels",
    "prompt_slots",
    "read_build_manifest",
    "read_paragraphs",
    "read_records",
    "record_bytes",
    "register_tool_format",
    "sha256_file",
    "source_names",
    "staging_name",
    "to_example",
    "tool_format_for",
    "tool_schema",
    "verify_build",
]
