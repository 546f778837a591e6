"""VLM `config.json`s (Gemma 3 image-text, LLaVA with a SigLIP encoder) <-> `VisionConfig`, and
where their checkpoints keep each part's tensors.

A VLM's `config.json` nests the decoder's own config (`text_config`, read as any text model's)
and the encoder's (`vision_config`). Checkpoints name the parts with one of several prefixes
(transformers 4 and the Hub: `language_model.model.`, `vision_tower.vision_model.`; transformers
5 in memory: `model.language_model.`, `model.vision_tower.`); the weight table is written with
the text models' names and `vision_tower.`/`multi_modal_projector.`, then renamed.
"""

from __future__ import annotations

import dataclasses
import json

from posttrain import paths
from posttrain.models._components import VisionConfig
from posttrain.models._config import ModelConfig

VLM_TYPES = ("gemma3", "llava")
VLM_ARCHITECTURES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
# Our names' prefixes and what checkpoints call them, the most specific first.
_PREFIXES = {
    "model.": ("model.language_model.", "language_model.model."),
    "lm_head.": ("language_model.lm_head.", "lm_head."),
    "vision_tower.": ("vision_tower.vision_model.", "model.vision_tower.", "vision_tower."),
    "multi_modal_projector.": ("model.multi_modal_projector.", "multi_modal_projector."),
}
# PIL's resampling filters by the number image processor configs store them as.
_RESAMPLE = {2: "bilinear", 3: "bicubic"}
# Where a model directory keeps its image processor's settings: on its own (the Hub's), or
# nested under "image_processor" (transformers 5's `Processor.save_pretrained`).
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# What `to_hf` writes: transformers 5's `save_pretrained` names.
EXPORT_PREFIXES = (
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


def vlm_from_hf(hf: dict) -> tuple[dict, VisionConfig, bool, tuple[str, ...]]:
    """`(text config.json, VisionConfig, tie_embeddings, unused)` of a VLM's `config.json`;
    `unused`: the encoder's tensor-name prefixes (after its own) of what the model does not run
    (LLaVA reads an earlier layer; SigLIP's pooling head), skipped when loading. ValueError for
    what the encoder cannot run."""
    model_type, v = hf["model_type"], hf.get("vision_config") or {}
    if v.get("model_type", "siglip_vision_model") not in ("siglip_vision_model", "siglip"):
        raise ValueError(f"vision_config model_type {v['model_type']!r} is not supported (siglip)")
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision hidden_act {v['hidden_act']!r} is not supported")
    text = dict(hf.get("text_config") or {})
    layers = int(v.get("num_hidden_layers", 12))
    image_size, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 16))
    patches = (image_size // patch) ** 2
    if model_type == "gemma3":
        text.setdefault("model_type", "gemma3_text")
        fields = dict(
            tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
            image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 262144))),
            projector="gemma3",
            final_norm=True,
            bidirectional=True,
            resample="bilinear",  # Gemma3ImageProcessor's
        )
        run = layers
    else:
        text.setdefault("model_type", "llama")
        act = hf.get("projector_hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"projector_hidden_act {act!r} is not supported (gelu)")
        feature_layer = hf.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int) or not -layers <= feature_layer < 0:
            raise ValueError(
                f"vision_feature_layer {feature_layer!r} is not supported (one layer, counted "
                f"from the end: -1 .. -{layers})"
            )
        drop = hf.get("vision_feature_select_strategy", "default") == "default"
        fields = dict(
            tokens_per_image=patches - drop,
            image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 32000))),
            projector="mlp",
            final_norm=False,
            drop_first_patch=drop,
            projector_bias=bool(hf.get("multimodal_projector_bias", True)),
            resample="bicubic",  # SiglipImageProcessor's
        )
        run = layers + 1 + feature_layer
    vision = VisionConfig(
        image_size=image_size,
        patch_size=patch,
        width=int(v.get("hidden_size", 768)),
        mlp_dim=int(v.get("intermediate_size", 3072)),
        num_layers=run,
        num_heads=int(v.get("num_attention_heads", 12)),
        channels=int(v.get("num_channels", 3)),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        **fields,
    )
    tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", model_type == "gemma3"))
    unused = tuple(f"encoder.layers.{i}." for i in range(run, layers)) + ("head.",)
    unused += () if vision.final_norm else ("post_layernorm.",)
    return text, vision, bool(tie), unused


def image_processor_fields(processor: dict) -> dict:
    """The `VisionConfig` fields an HF image processor config sets (`resample`, `image_mean`,
    `image_std`: those it has); ValueError for a resize filter the pipeline does not have."""
    fields = {}
    if "resample" in processor:
        resample = processor["resample"]
        if resample not in _RESAMPLE:
            raise ValueError(
                f"resample {resample!r} is not supported (2 bilinear or 3 bicubic, PIL's numbers)"
            )
        fields["resample"] = _RESAMPLE[resample]
    if processor.get("do_normalize", True):
        for key in ("image_mean", "image_std"):
            if processor.get(key) is not None:
                fields[key] = tuple(float(x) for x in processor[key])
    else:  # pixels stay rescaled to [0, 1]
        channels = len(processor.get("image_mean") or (0, 0, 0))
        fields["image_mean"], fields["image_std"] = (0.0,) * channels, (1.0,) * channels
    return fields


def with_image_processor(vision: VisionConfig, model_dir: str) -> VisionConfig:
    """`vision` with the resize filter, mean and std of `model_dir`'s image processor config
    (preprocessor_config.json, else processor_config.json's "image_processor"); as it is when
    the directory has neither. ValueError naming the file for what the pipeline cannot do."""
    for name in _PROCESSOR_FILES:
        file = paths.join(model_dir, name)
        if not paths.path(file).exists():
            continue
        try:
            processor = json.loads(paths.path(file).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
        if name == "processor_config.json":
            processor = processor.get("image_processor")
            if not isinstance(processor, dict):
                continue
        try:
            return dataclasses.replace(vision, **image_processor_fields(processor))
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None
    return vision


def vlm_to_hf(config: ModelConfig, text_hf: dict) -> dict:
    """A VLM's `config.json` around its decoder's (`text_hf`); ValueError for an encoder the
    HF types cannot say."""
    v = config.vision
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": v.width,
        "intermediate_size": v.mlp_dim,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_heads,
        "num_channels": v.channels,
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "layer_norm_eps": v.norm_eps,
        "vision_use_head": False,
    }
    common = {
        "vision_config": vision,
        "text_config": text_hf,
        "image_token_index": v.image_token_id,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": text_hf.get("dtype"),
    }
    if v.projector == "gemma3":
        if text_hf["model_type"] != "gemma3_text" or not (v.final_norm and v.bidirectional):
            raise ValueError(
                f"model {config.name!r}: a gemma3 projector goes with a Gemma 3 decoder, a final "
                f"encoder norm and bidirectional image attention"
            )
        return {"model_type": "gemma3", "mm_tokens_per_image": v.tokens_per_image, **common}
    if v.final_norm or v.bidirectional:
        raise ValueError(
            f"model {config.name!r}: HF llava has no final encoder norm before its projector and "
            f"no bidirectional image attention"
        )
    return {
        "model_type": "llava",
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default" if v.drop_first_patch else "full",
        "multimodal_projector_bias": v.projector_bias,
        "image_seq_length": v.tokens_per_image,
        **common,
    }


def keep_source_encoder(hf: dict, source: dict, *, head: bool) -> dict:
    """`hf`, a VLM export's `config.json`, with the encoder of `source` (the `config.json` of
    the directory the model was loaded from, whose unused encoder tensors the export carries):
    its layer count, LLaVA's feature layer read from the end of it, and a pooling head when the
    export carries one (`head`)."""
    v, s = dict(hf["vision_config"]), source.get("vision_config") or {}
    run = v["num_hidden_layers"]
    v["num_hidden_layers"] = int(s.get("num_hidden_layers", 12))
    v["vision_use_head"] = head
    out = {**hf, "vision_config": v}
    if hf["model_type"] == "llava":  # the layer the projector reads, counted from the end
        out["vision_feature_layer"] = run - v["num_hidden_layers"] - 1
    return out


def checkpoint_prefixes(names) -> tuple[tuple[str, str], ...]:
    """`(our prefix, the checkpoint's)` for each part of a VLM, from its tensor names."""
    out = []
    for ours, candidates in _PREFIXES.items():
        found = [c for c in candidates if any(n.startswith(c) for n in names)]
        out.append((ours, found[0] if found else candidates[-1]))
    text = dict(out)["model."]  # an untied lm_head sits beside the decoder it belongs to
    if not any(n.endswith("lm_head.weight") for n in names):
        lm = "language_model.lm_head." if text.startswith("language_model.") else "lm_head."
        out[1] = ("lm_head.", lm)
    return tuple(out)
