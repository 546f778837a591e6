"""What a VLM export carries besides the model's own weights, so that it holds every tensor of
the directory the model was loaded from and transformers loads every weight it expects.

A load leaves out the encoder tensors the model does not run (`CheckpointLayout.skipped`:
LLaVA's layers past its `vision_feature_layer` and its `post_layernorm`, SigLIP's pooling head).
A run's checkpoint holds only what the model runs, so the export re-reads them from that
directory (`to_hf(source=...)`; `posttrain export` finds it in the run's `model.hf_path`) and
writes them unchanged beside the model's, under a `config.json` that keeps the directory's
encoder layer count. The directory must still hold the model's architecture (same encoder, same
parameter shapes, the tensors its config declares), else the export is refused with the reason.
HF LLaVA's `post_layernorm`, which the projector never reads, is LayerNorm's initial ones and
zeros when no directory holds one (a preset).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from posttrain import paths
from posttrain.errors import UserError
from posttrain.models._config import ModelConfig
from posttrain.models._hf_config import load_hf_config_and_layout
from posttrain.models._hf_format import HFFormatError, read_json
from posttrain.models._hf_layout import CheckpointLayout, export_layout
from posttrain.models._hf_vlm import checkpoint_prefixes, keep_source_encoder
from posttrain.models._params import param_specs

# VisionConfig fields the image processor sets: they change no tensor.
_PROCESSOR_FIELDS = ("image_mean", "image_std", "resample")
_POST_NORM = ("post_layernorm.weight", "post_layernorm.bias")  # after the tower's prefix


@dataclasses.dataclass(frozen=True)
class Carried:
    """One tensor an export writes beside the model's own."""

    name: str  # its name in the export
    shape: tuple[int, ...]
    source_name: str | None  # its name in the source directory; None: LayerNorm's init


@dataclasses.dataclass(frozen=True)
class Carry:
    hf_config: dict  # the export's config.json
    tensors: list[Carried]
    files: object | None  # the source's tensors (`_hf._SafetensorsDir`), when it has any

    def read(self, entry: Carried, dtype: np.dtype) -> np.ndarray:
        """`entry`'s values in `dtype` (a source tensor read whole, as it is stored)."""
        if entry.source_name is None:
            fill = np.ones if entry.name.endswith(".weight") else np.zeros
            return fill(entry.shape, dtype)
        return np.asarray(self.files.read_whole(entry.source_name)).astype(dtype)


def plan_carry(
    config: ModelConfig, hf_config: dict, source: str | None, open_dir: Callable
) -> Carry:
    """What an export of a model of `config` (its `config.json` `hf_config`) carries from
    `source`, the HF directory the model was loaded from ("" for none: a preset), opened with
    `open_dir`. Refuses a VLM without `source` (None: ValueError), and a `source` that is gone
    or holds another model (`UserError`)."""
    if config.vision is None:
        return Carry(hf_config, [], None)
    if source is None:
        raise ValueError(
            f"model {config.name!r} is a VLM: pass source=<the HF directory it was loaded from> "
            "so that the export carries that directory's encoder tensors the model does not run "
            "(layers past the feature layer, the pooling head, post_layernorm) unchanged, or "
            "source='' for a model that was not loaded from one (e.g. a preset)"
        )
    tensors, files = [], None
    tower = dict(export_layout(config).prefixes).get("vision_tower.", "vision_tower.")
    if source:
        layout = _check_source(config, source)
        files = open_dir(source)
        layout = dataclasses.replace(layout, prefixes=checkpoint_prefixes(files.file_of))
        theirs = dict(layout.prefixes)["vision_tower."]
        for name in sorted(n for n in files.file_of if n.startswith(layout.skipped())):
            tensors.append(Carried(tower + name[len(theirs) :], files.shape(name), name))
        source_hf = read_json(paths.join(source, "config.json"))
        _check_layers(files, theirs, config.vision.num_layers, source_hf, source)
        head = any(t.name.startswith(tower + "head.") for t in tensors)
        hf_config = keep_source_encoder(hf_config, source_hf, head=head)
    if hf_config["model_type"] == "llava":
        have = {t.name for t in tensors}
        width = (config.vision.width,)
        tensors += [Carried(tower + n, width, None) for n in _POST_NORM if tower + n not in have]
    return Carry(hf_config, tensors, files)


def _shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    specs = param_specs(config)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: hasattr(x, "axes"))[0]
    return {jax.tree_util.keystr(path): spec.shape for path, spec in leaves}


def _check_source(config: ModelConfig, source: str) -> CheckpointLayout:
    """The layout of `source`, once it is known to hold the architecture of `config`."""
    reason = f"the export carries its encoder tensors that model {config.name!r} does not run"
    if not paths.path(paths.join(source, "config.json")).exists():
        gone = "has no config.json" if paths.path(source).is_dir() else "does not exist"
        raise UserError(
            f"{source}, the HF directory the model was loaded from, {gone}: {reason}; restore "
            "it or name a copy of it (--source=DIR, to_hf(source=...))"
        )
    try:
        theirs, layout = load_hf_config_and_layout(source)
    except HFFormatError as e:
        raise UserError(f"{e} ({reason})") from None
    ours = config.vision
    differ = [
        f.name
        for f in dataclasses.fields(ours)
        if f.name not in _PROCESSOR_FIELDS
        and (theirs.vision is None or getattr(theirs.vision, f.name) != getattr(ours, f.name))
    ]
    a, b = _shapes(config), _shapes(theirs)
    differ += sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if differ:
        raise UserError(
            f"{source} holds another model than {config.name!r} (its {', '.join(differ[:3])} "
            f"differ): {reason}; name the HF directory the model was loaded from"
        )
    return layout


def _check_layers(files, tower: str, run: int, source_hf: dict, source: str) -> None:
    """Every encoder layer `source`'s config.json declares past the `run` the model runs has the
    tensors of its first layer (which the load checked)."""
    layers = int((source_hf.get("vision_config") or {}).get("num_hidden_layers", 12))

    def suffixes(i: int) -> set[str]:
        prefix = f"{tower}encoder.layers.{i}."
        return {n[len(prefix) :] for n in files.file_of if n.startswith(prefix)}

    first = suffixes(0)
    for i in range(run, layers):
        missing = sorted(first - suffixes(i))
        if missing:
            raise UserError(
                f"{source} lacks {len(missing)} tensors of encoder layer {i} that its "
                f"config.json declares (e.g. {tower}encoder.layers.{i}.{missing[0]}); the export "
                "carries that layer unchanged: restore the directory"
            )
