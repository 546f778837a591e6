"""How each token is drawn: the one record of the sampling settings."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Temperature, top-p and top-k of a draw. `generate`, the engine's requests, `serve`,
    eval, RL rollouts (`rollout.sampling`), judges and the data tools take this record, so a
    setting is declared, documented and checked here only.

    Raises ValueError (a `ConfigError` naming the section inside a config) on a setting out of
    range."""

    temperature: float = 0.0  # 0 is greedy (argmax); > 0 samples softmax(logits / temperature)
    top_p: float = 1.0  # nucleus: keep the likeliest tokens until their mass reaches top_p, (0, 1]
    top_k: int = 0  # keep only the k likeliest tokens; 0 keeps every token

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):  # (NaN is False)
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:  # (NaN is False)
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
