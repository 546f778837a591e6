"""The model a loss trains, whatever holds its weights: a loss asks its `Policy` for the params
and forward arguments of the trained model (and of the frozen one, where there is one) and never
sees whether they are full weights or adapters on a frozen (possibly quantised) base."""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.lora._adapters import wrap
from posttrain.lora._config import LoRAConfig
from posttrain.models import hidden_states


@dataclasses.dataclass(frozen=True)
class Policy:
    """How a loss runs the trained model.

    Attributes:
      lora: the adapters' config; None: the trained params are the model's own.
      base: with `lora`, the frozen base the adapters wrap (a traced input of the step).
      key: where the model's trained params sit in the step's params (PPO's "policy", a
        reward model's "trunk" or "adapters"); None: the step's params are the model's.
    """

    lora: LoRAConfig | None = None
    base: Any = None
    key: str | None = None

    def __post_init__(self):
        if (self.lora is None) != (self.base is None):
            raise ValueError("a Policy takes a frozen base exactly when it has LoRA adapters")

    def apply(self, params) -> tuple[Any, dict]:
        """`(model params, forward kwargs)` of the trained model from the step's `params`."""
        trained = params[self.key] if self.key is not None else params
        return wrap(self.lora, self.base, trained)

    def forward(self, params, batch: dict, model_config, **extra) -> tuple[Any, Any, dict]:
        """`(model params, hidden states, aux)` of the trained model over a token batch
        (`tokens`, `positions`, `segment_ids`, a VLM's `images` when it has them); `extra`:
        more forward arguments (router replay's experts)."""
        model_params, (hidden, aux) = self._run(params, batch, model_config, **extra)
        return model_params, hidden, aux

    def sums(
        self, params, batch: dict, model_config, tail, rows: dict, aux_weight=None
    ) -> tuple[dict, dict]:
        """`(sums, aux)`: `tail(model params, hidden states, rows) -> sums` over the trained
        model's hidden states of a token batch, by row groups (the microbatches of a 1F1B
        pipeline; see `posttrain.models.hidden_states`); `rows`: the tail's per-row arrays;
        `aux_weight`: a MoE model's balance-loss weight in `loss_sum` (the token count)."""
        extra = dict(tail=tail, tail_rows=rows, tail_aux_weight=aux_weight)
        return self._run(params, batch, model_config, **extra)[1]

    def _run(self, params, batch: dict, model_config, **extra):
        model_params, kwargs = self.apply(params)
        out = hidden_states(
            model_params,
            batch["tokens"],
            model_config,
            batch["positions"],
            batch["segment_ids"],
            return_aux=True,
            images_BIHWC=batch.get("images"),
            **extra,
            **kwargs,
        )
        return model_params, out

    def frozen(self) -> tuple[Any, dict] | None:
        """`(params, forward kwargs)` of the frozen model the trained one adapts (the base with
        the adapters off: a reference that costs no second copy of the weights), or None when
        the trained params are the whole model."""
        if self.lora is None:
            return None
        return wrap(self.lora, self.base, None, adapters=False)

    def reference(self, ref_params=None) -> tuple[Any, dict]:
        """The frozen model if there is one, else `ref_params` (a separate reference copy).

        Raises:
          ValueError: neither a frozen model nor `ref_params`.
        """
        frozen = self.frozen()
        if frozen is not None:
            return frozen
        if ref_params is None:
            raise ValueError("this policy has no frozen model: pass the reference's params")
        return ref_params, {}
