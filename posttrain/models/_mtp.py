"""Multi-token prediction (MTP) modules: the extra layer DeepSeek-V3 trains after the last one to
predict the token after next, kept as a speculative drafter (`posttrain.sampling.MTP`).

The module at position i reads the model's final hidden state h_i and the next token t_{i+1}:

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])     # [2D] -> [D]
    g_i = final_norm(block(x_0 .. x_i))                      # one decoder block, causal
    logits_i = lm_head(g_i)                                  # predicts t_{i+2}

with the model's own embedding and output head (shared, as in DeepSeek-V3; checkpoints store
copies, which are not read). Its block is a layer of the model's kind (MLA, experts) with its
own KV cache. Drafting k tokens chains the module: g_i takes h's place for the next step, as
Megatron-LM's MTP layers chain their normed outputs (checkpoints with more than one MTP depth
draft with the first).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models._cache import KVCache, PagedKVCache
from posttrain.models._config import ModelConfig
from posttrain.models._embed import embed
from posttrain.models._ops import ParamSpec, dense, rms_norm
from posttrain.models._params import _block_specs, _is_spec, table_shardings
from posttrain.models._transformer import hidden_states


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The config of an MTP module's block: one layer of the model's kind (experts if the
    model has them), full attention."""
    return config.replace(
        num_layers=1, first_k_dense=0, sliding_window=None, sliding_window_layers=None
    )


def mtp_param_specs(config: ModelConfig) -> dict:
    """The module's weights (`config` is the model's); the block is a stack of one layer."""
    D, block = config.embed_dim, mtp_config(config)
    return {
        "enorm": ParamSpec((D,), ("embed",), "ones"),
        "hnorm": ParamSpec((D,), ("embed",), "ones"),
        "eh_proj": ParamSpec((2 * D, D), (None, "embed")),
        "layers": _block_specs(block, 1, moe=config.moe is not None),
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }


def mtp_param_shardings(config: ModelConfig, mesh) -> dict:
    return table_shardings(mtp_param_specs(config), mesh)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class MTPModule:
    """An MTP module's params (`mtp_param_specs`) and the config of the model it belongs to.

    `mtp_from_hf` loads one from a DeepSeek-V3 checkpoint; `init` draws a random one.
    """

    params: dict
    config: ModelConfig

    @property
    def block_config(self) -> ModelConfig:
        return mtp_config(self.config)

    @classmethod
    def init(cls, config: ModelConfig, seed: int = 0) -> MTPModule:
        """Random weights (normal, std 0.02; norms ones), drawn on the host."""
        rs = np.random.RandomState(seed)
        dtype = jnp.dtype(config.param_dtype)

        def leaf(spec):
            if spec.init in ("ones", "zeros"):
                return jnp.full(spec.shape, float(spec.init == "ones"), dtype)
            return jnp.asarray(0.02 * rs.standard_normal(spec.shape), dtype)

        return cls(jax.tree.map(leaf, mtp_param_specs(config), is_leaf=_is_spec), config)

    def __call__(
        self,
        model_params: dict,
        tokens_BL: jax.Array,
        previous_BLD: jax.Array,
        positions_BL: jax.Array | None = None,
        segment_ids_BL: jax.Array | None = None,
        cache: KVCache | PagedKVCache | None = None,
    ):
        """The module's normed outputs g `[B, L, D]` (logits: `lm_logits(model_params, g,
        config)`) for the next tokens `tokens_BL` (t_{i+1}) and the hidden states before them
        `previous_BLD` (h_i: the model's final hidden states, or the module's previous outputs
        when chaining) at positions i; `(g, cache)` with a cache (one layer, `block_config`)."""
        p, dt = self.params, self.config.dtype
        eps = self.config.norm_eps
        e_BLD = rms_norm(embed(model_params["embed"], tokens_BL, dt), p["enorm"], eps)
        h_BLD = rms_norm(previous_BLD.astype(dt), p["hnorm"], eps)
        x_BLD = dense(jnp.concatenate([e_BLD, h_BLD], axis=-1), p["eh_proj"].astype(dt))
        return hidden_states(
            p, tokens_BL, self.block_config, positions_BL, segment_ids_BL, cache, embeds_BLD=x_BLD
        )
