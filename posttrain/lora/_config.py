"""Which weights get LoRA adapters, and their rank and scale."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from posttrain.config import ConfigError

# The attention projections (grouped-query and MLA) and the dense SwiGLU of every layer.
DEFAULT_TARGETS = ("attn/(q|k|v|o|q_a|q_b|kv_a|kv_b)$", "mlp/(gate|up|down)$")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters `W + (alpha / rank) * A^T B` (contracting the rank) on the layer
    weights `targets` match.

    `A` starts as HF PEFT's kaiming-uniform (uniform in +-1/sqrt(fan_in)) and `B` at zero, so a
    fresh adapter leaves the model unchanged.
    """

    rank: int = 8  # r: the inner dimension of A [r, *in] and B [r, *out]
    alpha: float = 16.0  # the delta is scaled by alpha / rank
    # Dropout on the adapter input; adapters are merged into the weight one layer at a time,
    # which has no separate adapter input, so only 0 is supported.
    dropout: float = 0.0
    # Regexes searched in each layer weight's path ("layers/attn/q", "layers/moe/experts/up",
    # "dense_layers/mlp/down"); norms, biases and routers are never targets.
    targets: tuple[str, ...] = DEFAULT_TARGETS
    # QLoRA: store the frozen base's layer matrices quantised ("int8": per-output-channel
    # absmax; "nf4": 4-bit NormalFloat in blocks of `quant_block`), dequantised one layer at a
    # time in the forward pass; "" keeps the base in its param dtype.
    quantize: str = ""
    quant_block: int = 0  # elements per absmax block along the input dim; 0: the format's default

    def __post_init__(self):
        if self.quantize not in ("", "int8", "nf4"):
            raise ConfigError(f"lora.quantize={self.quantize!r}: use '', 'int8' or 'nf4'")
        if self.quant_block < 0:
            raise ConfigError(f"lora.quant_block={self.quant_block}: must be >= 0 (0: default)")
        if self.rank < 1:
            raise ConfigError(f"lora.rank={self.rank}: must be >= 1")
        if self.dropout != 0.0:
            raise ConfigError(
                f"lora.dropout={self.dropout}: adapters are merged into each layer's weights, "
                "so only dropout 0 is supported; set lora.dropout=0"
            )
        if not self.targets:
            raise ConfigError("lora.targets is empty: give at least one weight-path regex")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"lora.targets: {pattern!r} is not a regex ({e})") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, values: Mapping, where: str = "lora") -> LoRAConfig | None:
        """The config file's `lora` section: None unless `enabled`."""
        from posttrain.config import build

        values = dict(values)
        if not values.pop("enabled", True):
            if values.get("quantize"):
                raise ConfigError(
                    f"lora.quantize={values['quantize']!r} is set but lora.enabled=False: QLoRA "
                    "trains adapters on the quantised base; set lora.enabled=True"
                )
            return None
        return build(cls, values, where)
