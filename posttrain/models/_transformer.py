"""The decoder: a scanned stack of layers over params laid out by the table in `_params`.

Each layer is one block of `_block`. The forward pass is a pure function of (params, tokens);
`Transformer` pairs params with their config so a model is `model(tokens)`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models._attention import resolve_impl
from posttrain.models._block import _layer
from posttrain.models._cache import KVCache, PagedKVCache
from posttrain.models._config import ModelConfig
from posttrain.models._context import ring_devices, zigzag_rows
from posttrain.models._embed import input_embeddings, lm_logits
from posttrain.models._invariant import norm_rows
from posttrain.models._moe import moe_aux
from posttrain.models._nnx import NNXCache, nnx_hidden_states
from posttrain.models._ops import rms_norm
from posttrain.models._params import init_params
from posttrain.models._pipeline import pipeline_layers, pipeline_loss, stage_count
from posttrain.models._rope import rope_angles
from posttrain.models._vision import image_blocks

# Every policy keeps ring attention's output and log-normaliser (`_context`: named
# "context_attention"): its backward pass needs only them and the layer's q, k, v, so no
# policy recomputes the ring's forward hops (2 of the 7 matmul passes attention costs).
_RING = jax.checkpoint_policies.save_only_these_names("context_attention")


def _and_ring(policy: Callable) -> Callable:
    def saved(prim, *args, **params):
        return _RING(prim, *args, **params) or policy(prim, *args, **params)

    return saved


_REMAT_POLICIES: dict[str, Callable] = {
    "full": _RING,  # otherwise save nothing, recompute the whole layer
    "dots": _and_ring(jax.checkpoint_policies.checkpoint_dots),
    "dots_no_batch": _and_ring(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    # dots_no_batch, but the saved matmul outputs wait in host memory for the backward pass
    # instead of in HBM (a copy each way instead of a recompute).
    "offload_dots": _and_ring(
        jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    ),
}


def _stacks(config: ModelConfig) -> list[tuple[str, slice]]:
    """The scanned stacks in order (their params keys), each with the slice of layers (and
    cache) it covers."""
    k = config.first_k_dense
    stacks = [("layers", slice(k, config.num_layers))]
    if k:
        stacks.insert(0, ("dense_layers", slice(0, k)))
    return stacks


# `(one layer's params, that layer's slice of the extras) -> the params the layer runs with`:
# how wrappers (LoRA adapters, a quantised base) change the weights one layer at a time.
LayerTransform = Callable[[dict, object], dict]


def hidden_states(
    params: dict,
    tokens_BL: jax.Array,
    config: ModelConfig,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    cache: KVCache | PagedKVCache | None = None,
    *,
    return_aux: bool = False,
    layer_transform: LayerTransform | None = None,
    layer_extras: dict | None = None,
    embeds_BLD: jax.Array | None = None,
    replay_experts_BLTK: jax.Array | None = None,
    images_BIHWC: jax.Array | None = None,
    tail: Callable | None = None,
    tail_rows: dict | None = None,
    tail_aux_weight: jax.Array | None = None,
):
    """The final-normed residual stream `[B, L, D]` (what heads such as lm_head read).

    With a `cache`, returns `(hidden, cache)`: the tokens' keys and values are written into it
    and attention runs over it (see `KVCache`, `PagedKVCache`); with `return_aux` too,
    `(hidden, cache, aux)`. Else, with `return_aux`, returns `(hidden, aux)` with the MoE
    layers' losses, counts and routing (see `moe_aux`).

    `replay_experts_BLTK`: router replay, each token's experts in each MoE layer (T: the MoE
    layers, K: top-k) instead of the routers' own top-k, e.g. the sampler's routing
    (`aux["routed_experts"]`); a token whose first id is < 0 keeps its own routing.

    `layer_transform(layer_params, extra)` rewrites each layer's params inside the scan body,
    with `extra` that layer's slice of `layer_extras[stack]` (a pytree stacked like the layers,
    one entry per stack name: "layers", "dense_layers"), so only one layer's transformed weights
    exist at a time (LoRA merges its adapters there, QLoRA dequantises).

    `embeds_BLD`: the first layer's inputs instead of `tokens_BL`'s embeddings (a
    multi-token-prediction module's projection, `posttrain.models.MTPModule`); params then
    need no `embed`.

    `images_BIHWC`: a VLM's (`config.vision`) images, float pixels `[B, I, H, W, C]` resized
    and normalised; each row's image-token placeholders take that row's images' features in
    order (`posttrain.models._vision`).

    An NNX module (`config.nnx`) runs whole: `layer_transform` rewrites all its params at once.

    `tail(params, hidden_bLD, rows_b) -> sums`: the rest of a loss, for any group of rows with
    their slice of `tail_rows` (per-row arrays `[B, ...]`); its sums add over row groups. With
    a tail the call returns its sums over every row in place of the hidden states (with
    `return_aux`, `(sums, aux)`), and a pipeline with `config.pipeline_schedule == "1f1b"`
    runs it per microbatch inside its schedule (`posttrain.models._pipeline.pipeline_loss`:
    only `sums["loss_sum"]` is then differentiable, and a MoE model's balance loss enters it
    at `tail_aux_weight`, the loss's token count as `add_moe_aux` weighs it, its aux then
    carrying no gradient). No cache.
    """
    if tail is not None and cache is not None:
        raise ValueError("a loss tail runs over a training forward, not a cached one")
    if tail is not None:
        one_f_one_b = stage_count() > 1 and config.pipeline_schedule == "1f1b"
        if config.nnx is not None or not one_f_one_b:
            out = hidden_states(
                params, tokens_BL, config, positions_BL, segment_ids_BL, return_aux=True,
                layer_transform=layer_transform, layer_extras=layer_extras,
                embeds_BLD=embeds_BLD, replay_experts_BLTK=replay_experts_BLTK,
                images_BIHWC=images_BIHWC,
            )  # fmt: skip
            sums = tail(params, out[0], tail_rows)
            return (sums, out[1]) if return_aux else sums
    B, L = tokens_BL.shape
    if positions_BL is None:
        positions_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    if segment_ids_BL is None:
        segment_ids_BL = jnp.ones((B, L), jnp.int32)
    if config.nnx is not None:
        if embeds_BLD is not None or replay_experts_BLTK is not None or images_BIHWC is not None:
            raise ValueError("an NNX module takes tokens only (no embeds, no router replay)")
        if layer_transform is not None:  # (LoRA: the adapters are keyed like the params)
            params = layer_transform(params, layer_extras)
        out = nnx_hidden_states(config.nnx, params, tokens_BL, positions_BL, segment_ids_BL, cache)
        if not return_aux:
            return out
        return (*out, {}) if cache is not None else (out, {})
    x_BLD = input_embeddings(params, tokens_BL, config, embeds_BLD, images_BIHWC)
    pipelined = cache is None and stage_count() > 1
    # Length-sharded rows for ring attention: reordered once here for causal load balance
    # (`zigzag_rows`); back in order before the final norm.
    ring = ring_devices(x_BLD)
    zigzag = cache is None and not pipelined and config.context_parallel == "ring"
    zigzag &= ring > 1 and L % (2 * ring) == 0
    if zigzag:
        rows = ("act_batch", "act_length")
        x_BLD = zigzag_rows(x_BLD, (*rows, "act_embed"))
        positions_BL = zigzag_rows(positions_BL, rows)
        segment_ids_BL = zigzag_rows(segment_ids_BL, rows)
        if replay_experts_BLTK is not None:
            replay_experts_BLTK = zigzag_rows(replay_experts_BLTK, (*rows, None, None))
    cos, sin = rope_angles(positions_BL, config)

    windows = tuple(sorted(set(config.layer_windows)))
    window_index_T = jnp.asarray([windows.index(w) for w in config.layer_windows], jnp.int32)
    cache_kwargs = {}
    if cache is not None:
        kv_positions_BS, kv_segment_ids_BS, update, attend = cache.addressing(
            positions_BL, segment_ids_BL
        )
        cache_kwargs = dict(
            kv_positions_BS=kv_positions_BS,
            kv_segment_ids_BS=kv_segment_ids_BS,
            cache_update=update,
            cache_attend=attend,
        )
    impl = resolve_impl(config.attention, config.dtype, softcap=config.attn_softcap > 0)

    def build(cos, sin, positions_BL, segment_ids_BL, blocks_BL=None):
        """The layer function for rows with these per-row inputs."""
        layer = functools.partial(
            _layer,
            config=config,
            impl=impl,
            windows=windows,
            cos=cos,
            sin=sin,
            positions_BL=positions_BL,
            segment_ids_BL=segment_ids_BL,
            blocks_BL=blocks_BL,
            zigzag_rows=zigzag,
            **cache_kwargs,
        )
        if layer_transform is not None:
            inner = layer

            def layer(x, p, extra, *rest):
                return inner(x, layer_transform(p, extra), *rest)

        if config.remat != "none":
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)
        return layer

    side = (cos, sin, positions_BL, segment_ids_BL)
    if images_BIHWC is not None and config.vision.bidirectional:  # (Gemma 3)
        side += (image_blocks(tokens_BL, config.vision.image_token_id),)
        if cache is not None:  # a prefill's own tokens' blocks, in the slots it writes
            cache_kwargs["kv_blocks_BS"] = cache.blocks(side[-1])
    layer = build(*side)
    if replay_experts_BLTK is not None and (config.moe is None or pipelined):
        raise ValueError("router replay needs a MoE model without pipeline stages")
    replay_TBLK = None
    if replay_experts_BLTK is not None:
        replay_TBLK = jnp.moveaxis(replay_experts_BLTK, 2, 0)
    caches, aux_T = [], {}
    unstacked = isinstance(params["layers"], tuple)
    if unstacked:  # `unstack_layers`: a loop over each layer's arrays
        if cache is None or layer_transform is not None:
            raise ValueError("unstacked layers run only with a cache and no layer transform")
        k_T, v_T = cache.stores()  # tuples of per-layer stores (v: None for a combined pool)
        layers = params.get("dense_layers", ()) + params["layers"]
        auxes = []
        for i, p in enumerate(layers):
            moe = i - config.first_k_dense  # the MoE layers' index (their routing)
            replay = None if replay_TBLK is None or moe < 0 else replay_TBLK[moe]
            x_BLD, (kv, aux) = layer(x_BLD, p, window_index_T[i], k_T[i], v_T and v_T[i], replay)
            caches.append(kv)
            auxes += [aux] if aux else []
        caches = [(tuple(k for k, _ in caches), v_T and tuple(v for _, v in caches))]
        aux_T = jax.tree.map(lambda *a: jnp.stack(a), *auxes) if auxes else {}
    for name, layers in () if unstacked else _stacks(config):
        stack = params[name]
        xs = (stack, window_index_T[layers])
        if layer_transform is not None:
            xs = (stack, (layer_extras or {}).get(name), window_index_T[layers])
        if cache is not None:
            k_T, v_T = cache.stores()
            xs += jax.tree.map(lambda a, layers=layers: a[layers], (k_T, v_T))
        if replay_TBLK is not None and name == "layers":  # (the MoE stack)
            xs += (None, None) * (cache is None) + (replay_TBLK,)
        if pipelined and name == "layers" and tail is not None:  # 1F1B: the loss in the schedule
            if config.moe is not None and tail_aux_weight is None:
                raise ValueError(
                    "a MoE model's 1F1B pipeline needs tail_aux_weight: the weight of its "
                    "balance loss in the tail's loss_sum (the loss's token count)"
                )
            # The head's weights (the embedding when the head is tied to it).
            used = ("final_norm", "embed" if config.tie_embeddings else "lm_head")
            head = {k: params[k] for k in used}
            final = lambda p, h, rows: tail(p, _final_norm(h, p, config), rows)  # noqa: E731
            sums, aux = pipeline_loss(
                build, x_BLD, xs, side, tail_rows, final, head, aux_weight=tail_aux_weight,
                microbatches=config.pipeline_microbatches, remat=config.pipeline_remat,
            )  # fmt: skip
            return (sums, moe_aux(aux or aux_T)) if return_aux else sums
        if pipelined and name == "layers":  # (the first dense layers of a MoE model: a scan)
            micro = config.pipeline_microbatches
            x_BLD, aux = pipeline_layers(
                build, x_BLD, xs, side, microbatches=micro, remat=config.pipeline_remat
            )
            kv = None
        else:
            x_BLD, (kv, aux) = jax.lax.scan(lambda x, xs: layer(x, *xs), x_BLD, xs)
        caches.append(kv)
        aux_T = aux or aux_T
    if zigzag:
        x_BLD = zigzag_rows(x_BLD, ("act_batch", "act_length", "act_embed"), inverse=True)
    hidden_BLD = _final_norm(x_BLD, params, config)
    if cache is None:
        return (hidden_BLD, moe_aux(aux_T)) if return_aux else hidden_BLD
    if len(caches) > 1:
        k_T, v_T = jax.tree.map(lambda *a: jnp.concatenate(a), *caches)
    else:
        k_T, v_T = caches[0]
    new_cache = cache.updated(k_T, v_T, kv_positions_BS, kv_segment_ids_BS, L)
    return (hidden_BLD, new_cache, moe_aux(aux_T)) if return_aux else (hidden_BLD, new_cache)


def _final_norm(x_BLD, params, config):
    if config.batch_invariant:
        return norm_rows(x_BLD, params["final_norm"], config.norm_eps)
    return rms_norm(x_BLD, params["final_norm"], config.norm_eps, config.norm_offset)


def forward(
    params: dict,
    tokens_BL: jax.Array,
    config: ModelConfig,
    positions_BL: jax.Array | None = None,
    segment_ids_BL: jax.Array | None = None,
    cache: KVCache | None = None,
    *,
    return_aux: bool = False,
    layer_transform: LayerTransform | None = None,
    layer_extras: dict | None = None,
    images_BIHWC: jax.Array | None = None,
):
    """Logits `[B, L, V]` (float32) for int32 tokens `[B, L]`; `(logits, cache)` with a cache,
    `(logits, aux)` with `return_aux` (the MoE losses and counts, see `moe_aux`).

    Args:
      params: the params pytree (`init_params`, `from_hf`).
      tokens_BL: token ids.
      config: the model config.
      positions_BL: RoPE positions; default `0..L-1` in every row. Packed rows restart at 0 for
        each document.
      segment_ids_BL: packed-document ids; tokens attend only within their document. Default:
        one document per row. Padding may use any id of its own (0 by convention; MoE layers
        leave id 0 out of their balance losses and counts).
      cache: a `KVCache` to write these tokens into and attend over (incremental decoding);
        the updated cache is returned with the logits.
      return_aux: also return the MoE auxiliary outputs (no cache).
      layer_transform, layer_extras: rewrite each layer's params inside the scan (LoRA,
        QLoRA); see `hidden_states`.
      images_BIHWC: a VLM's images for its image tokens (see `hidden_states`).
    """
    out = hidden_states(
        params,
        tokens_BL,
        config,
        positions_BL,
        segment_ids_BL,
        cache,
        return_aux=return_aux,
        layer_transform=layer_transform,
        layer_extras=layer_extras,
        images_BIHWC=images_BIHWC,
    )
    if cache is None and not return_aux:
        return lm_logits(params, out, config)
    return lm_logits(params, out[0], config), out[1]


def init_cache(config: ModelConfig, batch: int, length: int) -> KVCache | NNXCache:
    """An empty decoding cache of `length` slots per row (an NNX module: its token buffer)."""
    if config.nnx is not None:
        return NNXCache.init(batch, length)
    return KVCache.init(config, batch, length)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class Transformer:
    """A model is its config plus its params: `model(tokens) -> logits`; a pytree for `jax.jit`."""

    params: dict
    config: ModelConfig

    def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, cache=None, images=None):
        return forward(
            self.params, tokens_BL, self.config, positions_BL, segment_ids_BL, cache,
            images_BIHWC=images,
        )  # fmt: skip

    def hidden_states(self, tokens_BL, positions_BL=None, segment_ids_BL=None, cache=None):
        return hidden_states(
            self.params, tokens_BL, self.config, positions_BL, segment_ids_BL, cache
        )

    @classmethod
    def init(cls, config: ModelConfig, rng: jax.Array | int = 0, mesh=None) -> Transformer:
        """A randomly initialised model (sharded over `mesh` if given)."""
        if isinstance(rng, int | np.integer):
            rng = jax.random.key(int(rng))
        return cls(init_params(config, rng, mesh), config)
