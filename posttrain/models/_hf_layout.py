"""How an HF checkpoint lays out what `ModelConfig` does not describe (`CheckpointLayout`)."""

from __future__ import annotations

import dataclasses

from posttrain.models._config import ModelConfig
from posttrain.models._hf_format import _ALIASES
from posttrain.models._hf_vlm import EXPORT_PREFIXES, VLM_TYPES, vlm_from_hf


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """How an HF checkpoint stores what `ModelConfig` does not describe."""

    rope_interleave: bool = False  # MLA: each head's rope dims are stored as pairs (0,1),(2,3)..
    extra_layers: int = 0  # DeepSeek multi-token-prediction layers after the last; not loaded
    # VLMs: (our name prefix, the checkpoint's) per part (`_hf_vlm.checkpoint_prefixes`), and
    # the encoder's parts the model does not run (after the encoder's prefix; not loaded).
    prefixes: tuple[tuple[str, str], ...] = ()
    vision_unused: tuple[str, ...] = ()

    def skipped(self) -> tuple[str, ...]:
        """Checkpoint-name prefixes of tensors a load leaves out on purpose."""
        tower = dict(self.prefixes).get("vision_tower.", "vision_tower.")
        return tuple(tower + part for part in self.vision_unused)


def checkpoint_layout(hf: dict) -> CheckpointLayout:
    """The layout a `config.json` declares (transformers' defaults where it is silent); a
    VLM's `prefixes` come from its tensor names (`_hf_vlm.checkpoint_prefixes`)."""
    if hf.get("model_type") in VLM_TYPES:
        return CheckpointLayout(vision_unused=vlm_from_hf(hf)[3])
    if _ALIASES.get(hf.get("model_type"), hf.get("model_type")) != "deepseek_v3":
        return CheckpointLayout()
    extra = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 1))
    return CheckpointLayout(
        rope_interleave=bool(hf.get("rope_interleave", True)), extra_layers=int(extra or 0)
    )


def export_layout(config: ModelConfig) -> CheckpointLayout:
    """The layout `to_hf` writes: DeepSeek's usual interleaved rope, no MTP layers, a VLM's
    parts named as transformers 5 saves them."""
    prefixes = EXPORT_PREFIXES if config.vision is not None else ()
    return CheckpointLayout(rope_interleave=config.mla is not None, prefixes=prefixes)
