"""What a sampler runs: the policy's weights from the trained params (`SamplerWeights`), on the
trainer's devices, on each process's own devices, or sent to a decoupled sampler's devices
(`SamplerSide`: with LoRA only the adapters travel)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from posttrain.lora import adapter_shardings, merge
from posttrain.models import param_shardings
from posttrain.parallel import process_meshes, to_process_local
from posttrain.rl._config import RLConfig
from posttrain.rl._scorer import policy_params
from posttrain.train import base_shardings


@dataclasses.dataclass(frozen=True)
class SamplerSide:
    """How a decoupled sampler gets its weights: `published(trained params)` is what the
    trainer sends each step (the policy; with LoRA only its adapters), placed on the sampler's
    devices with `shardings`; `prepare(sent) -> weights` runs there (LoRA: merges the adapters
    into the sampler's own copy of the base)."""

    published: Callable[[Any], Any]
    shardings: Any
    prepare: Callable[[Any], Any]


class SamplerWeights:
    """What the sampler runs: the policy's params, or with LoRA the frozen base with the
    adapters merged in. A co-located sampler merges on the trainer's devices; a decoupled one
    (`on(sampler_mesh)`) keeps its own copy of the base and is sent only the adapters."""

    def __init__(self, c: RLConfig, model_config, mesh, base=None):
        self.c, self.model_config, self.base, self.lora = c, model_config, base, c.lora
        if self.lora is not None:
            self._merge = self._merger(mesh)
        self._local = None
        # (several processes, per_process: each samples its prompts on its own devices)
        if jax.process_count() > 1 and c.rollout.sampler_mesh == "per_process":
            self._local_mesh, self._stacked = process_meshes(mesh.devices.flat)
            self._local = param_shardings(model_config, self._local_mesh)

    def _merger(self, mesh):
        lora = self.lora
        shardings = param_shardings(self.model_config, mesh)
        return jax.jit(lambda base, adapters: merge(base, adapters, lora), out_shardings=shardings)

    def __call__(self, params):
        """The sampler's weights from the trained params (co-located)."""
        policy = policy_params(self.c, params)
        weights = policy if self.lora is None else self._merge(self.base, policy)
        if self._local is None:
            return weights
        return to_process_local(weights, self._local, self._stacked)

    def on(self, sampler_mesh) -> SamplerSide:
        """The decoupled sampler's side: what is sent (`published`), how it is placed on
        `sampler_mesh` and turned into weights there."""
        published = lambda params: policy_params(self.c, params)  # noqa: E731
        lora, model_config = self.lora, self.model_config
        if self._local is not None and lora is None:
            # Each process's sampler gets its own copy, device to device.
            shardings = param_shardings(model_config, sampler_mesh)
            return SamplerSide(
                lambda params: to_process_local(published(params), self._local, self._stacked),
                shardings,
                prepare=lambda weights: weights,
            )
        if lora is None:
            shardings = param_shardings(model_config, sampler_mesh)
            return SamplerSide(published, shardings, prepare=lambda weights: weights)
        base = self.base
        if self._local is not None:  # each process's sampler: its own base, then adapters
            local = adapter_shardings(model_config, lora, self._local_mesh)
            base = to_process_local(
                base, base_shardings(lora, model_config, self._local_mesh), self._stacked
            )
            published = lambda params: to_process_local(  # noqa: E731
                policy_params(self.c, params), local, self._stacked
            )
        base = jax.device_put(base, base_shardings(lora, model_config, sampler_mesh))
        merge_there = self._merger(sampler_mesh)
        shardings = adapter_shardings(model_config, lora, sampler_mesh)
        return SamplerSide(published, shardings, prepare=lambda a: merge_there(base, a))
