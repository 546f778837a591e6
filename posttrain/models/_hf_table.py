"""The weight table of HF interop: which HF tensors make up each of our params, and how.

Our weights are `[in, out]` with heads split out and layers (and experts) stacked; HF stores one
`[out, in]` tensor per layer (and per expert). MLA checkpoints may also store each head's rope
dimensions as interleaved pairs, which we permute into the halves our RoPE rotates.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from posttrain.models._config import ModelConfig
from posttrain.models._hf_layout import CheckpointLayout

Convert = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """How one of our params maps to HF tensors.

    `hf_name` holds `{i}` for the HF layer index when our param stacks layers in its first
    dimension, and `{j}` for the expert when it stacks experts in its second; `hf_shape`,
    `to_ours` and `to_hf` are about one such HF tensor and its slice of our param.
    """

    path: tuple[str, ...]
    hf_name: str
    hf_shape: tuple[int, ...]
    to_ours: Convert
    to_hf: Convert
    first_layer: int = 0  # HF index of layer 0 of our stack

    @property
    def stacked_dims(self) -> int:
        """Leading dimensions of our param that index HF tensors (layers, then experts)."""
        return ("{i}" in self.hf_name) + ("{j}" in self.hf_name)

    def name(self, index: tuple[int, ...]) -> str:
        """The HF name of the tensor at `index` into our leading (stacked) dimensions."""
        layer = index[0] + self.first_layer if index else None
        return self.hf_name.format(i=layer, j=index[1] if len(index) > 1 else None)

    def pieces(self, shape: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], str]]:
        """`(index into our leading dims, HF name)` of each HF tensor of a param of `shape`."""
        for index in itertools.product(*(range(n) for n in shape[: self.stacked_dims])):
            yield index, self.name(index)


def weight_table(config: ModelConfig, layout: CheckpointLayout) -> list[HFTensor]:
    """Every param of `config` (see `param_specs`) and the HF tensors it comes from."""
    D, V = config.embed_dim, config.vocab_size
    table = [
        HFTensor(("embed",), "model.embed_tokens.weight", (V, D), _same, _same),
        HFTensor(("final_norm",), "model.norm.weight", (D,), _same, _same),
    ]
    if not config.tie_embeddings:
        table.append(HFTensor(("lm_head",), "lm_head.weight", (V, D), _t, _t))
    k = config.first_k_dense
    table += _stack(_block(config, layout, moe=config.moe is not None), "layers", k)
    if k:
        table += _stack(_block(config, layout, moe=False), "dense_layers", 0)
    if config.vision is not None:
        table += _vision(config)
    return [_renamed(e, layout.prefixes) for e in table] if layout.prefixes else table


def _renamed(entry: HFTensor, prefixes) -> HFTensor:
    """`entry` with its HF name's leading prefix replaced as the checkpoint names it."""
    for ours, theirs in prefixes:
        if entry.hf_name.startswith(ours):
            return dataclasses.replace(entry, hf_name=theirs + entry.hf_name[len(ours) :])
    return entry


def _vision(c: ModelConfig) -> list[HFTensor]:
    """A VLM's SigLIP encoder and projector (`_vision.vision_param_specs`)."""
    v, D = c.vision, c.embed_dim
    W, M, N, P, C = v.width, v.mlp_dim, v.num_heads, v.patch_size, v.channels
    H = W // N
    e, layer = "vision_tower.embeddings.", "vision_tower.encoder.layers.{i}."
    patch = (  # conv [W, C, P, P] <-> ours [P * P * C, W] (patch pixels row-major, channels last)
        lambda w: w.transpose(2, 3, 1, 0).reshape(P * P * C, W),
        lambda w: w.reshape(P, P, C, W).transpose(3, 2, 0, 1),
    )
    heads = (lambda w: w.reshape(N, H), lambda w: w.reshape(N * H))
    table = [
        HFTensor(("vision", "patch"), e + "patch_embedding.weight", (W, C, P, P), *patch),
        HFTensor(("vision", "patch_bias"), e + "patch_embedding.bias", (W,), _same, _same),
        HFTensor(("vision", "position"), e + "position_embedding.weight", (v.num_patches, W),
                 _same, _same),
    ]  # fmt: skip
    block = [
        ("norm1", "layer_norm1.weight", (W,), _same, _same),
        ("norm1_bias", "layer_norm1.bias", (W,), _same, _same),
        ("norm2", "layer_norm2.weight", (W,), _same, _same),
        ("norm2_bias", "layer_norm2.bias", (W,), _same, _same),
        ("o", "self_attn.out_proj.weight", (W, W), *_heads_out(N, H, W)),
        ("o_bias", "self_attn.out_proj.bias", (W,), _same, _same),
        ("fc1", "mlp.fc1.weight", (M, W), _t, _t),
        ("fc1_bias", "mlp.fc1.bias", (M,), _same, _same),
        ("fc2", "mlp.fc2.weight", (W, M), _t, _t),
        ("fc2_bias", "mlp.fc2.bias", (W,), _same, _same),
    ]
    for n in ("q", "k", "v"):
        block += [
            (n, f"self_attn.{n}_proj.weight", (W, W), *_heads_in(N, H, W)),
            (f"{n}_bias", f"self_attn.{n}_proj.bias", (W,), *heads),
        ]
    table += [HFTensor(("vision", "layers", p), layer + hf, *rest) for p, hf, *rest in block]
    if v.final_norm:
        table += [
            HFTensor(("vision", "final_norm"), "vision_tower.post_layernorm.weight", (W,),
                     _same, _same),
            HFTensor(("vision", "final_norm_bias"), "vision_tower.post_layernorm.bias", (W,),
                     _same, _same),
        ]  # fmt: skip
    proj, path = "multi_modal_projector.", ("vision", "projector")
    if v.projector == "gemma3":
        return table + [
            HFTensor((*path, "norm"), proj + "mm_soft_emb_norm.weight", (W,), _same, _same),
            HFTensor((*path, "proj"), proj + "mm_input_projection_weight", (W, D), _same, _same),
        ]
    table += [
        HFTensor((*path, "fc1"), proj + "linear_1.weight", (D, W), _t, _t),
        HFTensor((*path, "fc2"), proj + "linear_2.weight", (D, D), _t, _t),
    ]
    if v.projector_bias:
        table += [
            HFTensor((*path, "fc1_bias"), proj + "linear_1.bias", (D,), _same, _same),
            HFTensor((*path, "fc2_bias"), proj + "linear_2.bias", (D,), _same, _same),
        ]
    return table


def mtp_weight_table(config: ModelConfig, layout: CheckpointLayout) -> list[HFTensor]:
    """The params of the first MTP layer (`mtp_param_specs`): HF layer `num_layers`. Its copies
    of the embedding and output head (`embed_tokens`, `shared_head.head`) are not read."""
    D, layer = config.embed_dim, f"model.layers.{config.num_layers}."
    table = [
        HFTensor((name,), layer + hf, (D,), _same, _same)
        for name, hf in [
            ("enorm", "enorm.weight"),
            ("hnorm", "hnorm.weight"),
            ("final_norm", "shared_head.norm.weight"),
        ]
    ]
    table.append(HFTensor(("eh_proj",), layer + "eh_proj.weight", (D, 2 * D), _t, _t))
    block = _block(config, layout, moe=config.moe is not None)
    return table + _stack(block, "layers", config.num_layers)


def _same(w):
    return w


def _t(w):
    return w.T


def _stack(block: list[HFTensor], name: str, first_layer: int) -> list[HFTensor]:
    return [dataclasses.replace(e, path=(name, *e.path), first_layer=first_layer) for e in block]


def _block(c: ModelConfig, layout: CheckpointLayout, moe: bool) -> list[HFTensor]:
    """One decoder layer's tensors, paths relative to the stack."""
    D, layer = c.embed_dim, "model.layers.{i}."
    # Gemma's post-norm layers name their four norms by place; a pre-norm layer's second norm
    # is its "post_attention_layernorm".
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    if c.post_norms:
        norms = {
            "attn_norm": "input_layernorm",
            "attn_post_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "mlp_post_norm": "post_feedforward_layernorm",
        }
    table = [
        HFTensor((ours,), f"{layer}{hf}.weight", (D,), _same, _same) for ours, hf in norms.items()
    ]
    table += _mla(c, layout) if c.mla is not None else _attention(c)
    table += _moe(c) if moe else _mlp(("mlp",), layer + "mlp.", D, c.mlp_dim)
    return table


def _heads_in(n: int, h: int, d_in: int) -> tuple[Convert, Convert]:
    """HF `[n*h, d_in]` <-> ours `[d_in, n, h]` (a projection into heads)."""
    return (
        lambda w: w.reshape(n, h, d_in).transpose(2, 0, 1),
        lambda w: w.transpose(1, 2, 0).reshape(n * h, d_in),
    )


def _heads_out(n: int, h: int, d_out: int) -> tuple[Convert, Convert]:
    """HF `[d_out, n*h]` <-> ours `[n, h, d_out]` (the projection out of heads)."""
    return (
        lambda w: w.reshape(d_out, n, h).transpose(1, 2, 0),
        lambda w: w.transpose(2, 0, 1).reshape(d_out, n * h),
    )


def _attention(c: ModelConfig) -> list[HFTensor]:
    D, N, K, H = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    attn = "model.layers.{i}.self_attn."

    def bias(n):  # HF [n*H] <-> ours [n, H]
        return (lambda w: w.reshape(n, H), lambda w: w.reshape(n * H))

    table = [
        HFTensor(("attn", "q"), attn + "q_proj.weight", (N * H, D), *_heads_in(N, H, D)),
        HFTensor(("attn", "k"), attn + "k_proj.weight", (K * H, D), *_heads_in(K, H, D)),
        HFTensor(("attn", "v"), attn + "v_proj.weight", (K * H, D), *_heads_in(K, H, D)),
        HFTensor(("attn", "o"), attn + "o_proj.weight", (D, N * H), *_heads_out(N, H, D)),
    ]
    if c.qkv_bias:
        table += [
            HFTensor(("attn", "q_bias"), attn + "q_proj.bias", (N * H,), *bias(N)),
            HFTensor(("attn", "k_bias"), attn + "k_proj.bias", (K * H,), *bias(K)),
            HFTensor(("attn", "v_bias"), attn + "v_proj.bias", (K * H,), *bias(K)),
        ]
    if c.o_bias:
        table.append(HFTensor(("attn", "o_bias"), attn + "o_proj.bias", (D,), _same, _same))
    if c.qk_norm:
        table += [
            HFTensor(("attn", "q_norm"), attn + "q_norm.weight", (H,), _same, _same),
            HFTensor(("attn", "k_norm"), attn + "k_norm.weight", (H,), _same, _same),
        ]
    return table


def _rope_halves(
    conv: tuple[Convert, Convert], width: int, rope: int, interleaved: bool
) -> tuple[Convert, Convert]:
    """`conv` plus, for interleaved checkpoints, a permutation of the last `rope` of the `width`
    output dims from pairs `(0, 1), (2, 3), ...` into halves `(0, 2, ...), (1, 3, ...)`."""
    if not interleaved:
        return conv
    halves = np.arange(rope).reshape(-1, 2).T.reshape(-1)  # 0, 2, 4, .., 1, 3, 5, ..
    perm = np.concatenate([np.arange(width - rope), width - rope + halves])
    inverse = np.argsort(perm)
    to_ours, to_hf = conv
    return (lambda w: to_ours(w)[..., perm], lambda w: to_hf(w[..., inverse]))


def _mla(c: ModelConfig, layout: CheckpointLayout) -> list[HFTensor]:
    m, D, N = c.mla, c.embed_dim, c.num_heads
    Q, R, r = m.qk_head_dim, m.kv_lora_rank, m.qk_rope_head_dim
    KV, interleaved = m.qk_nope_head_dim + m.v_head_dim, layout.rope_interleave
    attn = "model.layers.{i}.self_attn."
    if m.q_lora_rank:
        Rq = m.q_lora_rank
        q = [
            HFTensor(("attn", "q_a"), attn + "q_a_proj.weight", (Rq, D), _t, _t),
            HFTensor(("attn", "q_norm"), attn + "q_a_layernorm.weight", (Rq,), _same, _same),
            HFTensor(
                ("attn", "q_b"),
                attn + "q_b_proj.weight",
                (N * Q, Rq),
                *_rope_halves(_heads_in(N, Q, Rq), Q, r, interleaved),
            ),
        ]
    else:
        q = [
            HFTensor(
                ("attn", "q"),
                attn + "q_proj.weight",
                (N * Q, D),
                *_rope_halves(_heads_in(N, Q, D), Q, r, interleaved),
            )
        ]
    return q + [
        HFTensor(
            ("attn", "kv_a"),
            attn + "kv_a_proj_with_mqa.weight",
            (R + r, D),
            *_rope_halves((_t, _t), R + r, r, interleaved),
        ),
        HFTensor(("attn", "kv_norm"), attn + "kv_a_layernorm.weight", (R,), _same, _same),
        HFTensor(("attn", "kv_b"), attn + "kv_b_proj.weight", (N * KV, R), *_heads_in(N, KV, R)),
        HFTensor(
            ("attn", "o"),
            attn + "o_proj.weight",
            (D, N * m.v_head_dim),
            *_heads_out(N, m.v_head_dim, D),
        ),
    ]


def _mlp(path: tuple[str, ...], prefix: str, D: int, F: int) -> list[HFTensor]:
    """A SwiGLU: HF `{prefix}{gate,up,down}_proj.weight`, ours `path + (gate|up|down,)`."""
    return [
        HFTensor((*path, "gate"), prefix + "gate_proj.weight", (F, D), _t, _t),
        HFTensor((*path, "up"), prefix + "up_proj.weight", (F, D), _t, _t),
        HFTensor((*path, "down"), prefix + "down_proj.weight", (D, F), _t, _t),
    ]


def _moe(c: ModelConfig) -> list[HFTensor]:
    e, D, mlp = c.moe, c.embed_dim, "model.layers.{i}.mlp."
    table = [HFTensor(("moe", "router"), mlp + "gate.weight", (e.num_experts, D), _t, _t)]
    if e.use_routing_bias:
        table.append(
            HFTensor(
                ("moe", "routing_bias"),
                mlp + "gate.e_score_correction_bias",
                (e.num_experts,),
                _same,
                _same,
            )
        )
    table += _mlp(("moe", "experts"), mlp + "experts.{j}.", D, e.expert_mlp_dim)
    if e.num_shared_experts:
        Fs = e.expert_mlp_dim * e.num_shared_experts
        table += _mlp(("moe", "shared"), mlp + "shared_experts.", D, Fs)
    return table
