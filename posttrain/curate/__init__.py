"""Curate: the offline data tools behind `posttrain data`: clean, dedup, decontaminate, build
and diff, stratify, on-policy pairs and rejection-sampled synth, the CAD task files, and small
BPE tokenizers for models trained from scratch."""

from posttrain.curate._bpe import CHATML_TEMPLATE, TOOL_CHAT_TEMPLATE, train_tokenizer
from posttrain.curate._build import BuildDiff, BuildResult, RecordChange
from posttrain.curate._build import build as build_dataset
from posttrain.curate._build import diff as diff_builds
from posttrain.curate._cad_tasks import ASSET_FILES as CAD_ASSET_FILES
from posttrain.curate._cad_tasks import build_cad_assets
from posttrain.curate._clean import CleanConfig, clean
from posttrain.curate._decontam import DecontamConfig, decontaminate
from posttrain.curate._dedup import DedupConfig, dedup
from posttrain.curate._on_policy import SampleConfig, make_pairs, pass_rates, synthesize
from posttrain.curate._shingles import normalize, record_text
from posttrain.curate._stratify import bucket_names, read_pass_rates, stratify, stratify_records

__all__ = [
    "BuildDiff",
    "BuildResult",
    "CAD_ASSET_FILES",
    "CHATML_TEMPLATE",
    "CleanConfig",
    "DecontamConfig",
    "DedupConfig",
    "RecordChange",
    "SampleConfig",
    "TOOL_CHAT_TEMPLATE",
    "bucket_names",
    "build_cad_assets",
    "build_dataset",
    "clean",
    "decontaminate",
    "dedup",
    "diff_builds",
    "make_pairs",
    "normalize",
    "pass_rates",
    "read_pass_rates",
    "record_text",
    "stratify",
    "stratify_records",
    "synthesize",
    "train_tokenizer",
]
