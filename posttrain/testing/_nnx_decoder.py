"""A decoder written as a user writes one in Flax NNX, to post-train with posttrain.

    posttrain train --config=configs/nnx.py:sft --workdir=/tmp/nnx_sft

Nothing here imports posttrain's model code: RMSNorm, grouped-query attention with RoPE and a
gated MLP in plain `jax.numpy`, each weight annotated with logical axes
(`nnx.with_partitioning`), which posttrain's rules map onto the mesh. `style="llama"` computes
what posttrain's own Llama decoder computes (so the two can be compared weight for weight);
`style="gemma"` is Gemma's recipe: embeddings scaled by sqrt(D), norms scaled by (1 + w) from
zero, a GELU-gated MLP, tied embeddings and soft-capped final logits.

It follows posttrain's call contract (`posttrain.models._nnx`): `module(tokens, positions,
segment_ids) -> logits`, and `hidden_states` / `logits` for chunked losses and reward heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_NORMAL = nnx.initializers.normal(0.02)


def _param(rngs, shape, axes, init=_NORMAL, dtype=jnp.float32):
    return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, gemma: bool, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.zeros if gemma else nnx.initializers.ones
        self.scale = _param(rngs, (dim,), ("embed",), init, dtype)
        self.eps, self.gemma = eps, gemma

    def __call__(self, x_BLD):
        x32 = x_BLD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = 1.0 + self.scale[...] if self.gemma else self.scale[...]
        return scale.astype(x_BLD.dtype) * normed.astype(x_BLD.dtype)


def _rope(x_BLNH, positions_BL, theta: float):
    """HF's rotate-half rotary embedding."""
    H = x_BLNH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    angles_BLh = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles_BLh)[:, :, None], jnp.sin(angles_BLh)[:, :, None]
    x1, x2 = jnp.split(x_BLNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLNH.dtype)


class Attention(nnx.Module):
    def __init__(self, D: int, N: int, K: int, H: int, *, theta: float, dtype, rngs: nnx.Rngs):
        self.q = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), dtype=dtype)
        self.k = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype=dtype)
        self.v = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), dtype=dtype)
        self.o = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype=dtype)
        self.theta = theta

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        q_BLNH = _rope(jnp.einsum("BLD,DNH->BLNH", x_BLD, self.q[...]), positions_BL, self.theta)
        k_BLKH = _rope(jnp.einsum("BLD,DKH->BLKH", x_BLD, self.k[...]), positions_BL, self.theta)
        v_BLKH = jnp.einsum("BLD,DKH->BLKH", x_BLD, self.v[...])
        N, K, H = q_BLNH.shape[2], k_BLKH.shape[2], q_BLNH.shape[3]
        k_BLNH = jnp.repeat(k_BLKH, N // K, axis=2)
        v_BLNH = jnp.repeat(v_BLKH, N // K, axis=2)
        scores_BNLS = jnp.einsum("BLNH,BSNH->BNLS", q_BLNH, k_BLNH).astype(jnp.float32) * H**-0.5
        L = x_BLD.shape[1]
        causal_LS = jnp.tril(jnp.ones((L, L), bool))
        same_BLS = segment_ids_BL[:, :, None] == segment_ids_BL[:, None, :]
        mask_B1LS = (causal_LS[None] & same_BLS)[:, None]
        scores_BNLS = jnp.where(mask_B1LS, scores_BNLS, jnp.finfo(jnp.float32).min)
        probs_BNLS = jax.nn.softmax(scores_BNLS, axis=-1).astype(x_BLD.dtype)
        out_BLNH = jnp.einsum("BNLS,BSNH->BLNH", probs_BNLS, v_BLNH)
        return jnp.einsum("BLNH,NHD->BLD", out_BLNH, self.o[...])


class MLP(nnx.Module):
    def __init__(self, D: int, F: int, *, gelu: bool, dtype, rngs: nnx.Rngs):
        self.gate = _param(rngs, (D, F), ("embed", "mlp"), dtype=dtype)
        self.up = _param(rngs, (D, F), ("embed", "mlp"), dtype=dtype)
        self.down = _param(rngs, (F, D), ("mlp", "embed"), dtype=dtype)
        self.gelu = gelu

    def __call__(self, x_BLD):
        gate_BLF = x_BLD @ self.gate[...]
        act = jax.nn.gelu(gate_BLF, approximate=True) if self.gelu else jax.nn.silu(gate_BLF)
        return (act * (x_BLD @ self.up[...])) @ self.down[...]


class Block(nnx.Module):
    def __init__(self, D, N, K, H, F, *, eps, theta, gemma: bool, dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(D, eps=eps, gemma=gemma, dtype=dtype, rngs=rngs)
        self.attn = Attention(D, N, K, H, theta=theta, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(D, eps=eps, gemma=gemma, dtype=dtype, rngs=rngs)
        self.mlp = MLP(D, F, gelu=gemma, dtype=dtype, rngs=rngs)

    def __call__(self, x_BLD, positions_BL, segment_ids_BL):
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL)
        return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class Decoder(nnx.Module):
    """A decoder-only transformer (see the module docstring for the two styles)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        embed_dim: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mlp_dim: int,
        style: str = "llama",
        rope_theta: float = 10_000.0,
        norm_eps: float = 1e-6,
        final_softcap: float = 30.0,
        max_seq_len: int = 512,
        param_dtype: str = "float32",
        rngs: nnx.Rngs,
    ):
        if style not in ("llama", "gemma"):
            raise ValueError(f"style={style!r}: use 'llama' or 'gemma'")
        gemma, dtype = style == "gemma", jnp.dtype(param_dtype)
        D = embed_dim
        self.embed = _param(rngs, (vocab_size, D), ("vocab", "embed"), dtype=dtype)
        self.layers = nnx.List(
            [
                Block(
                    D,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    mlp_dim,
                    eps=norm_eps,
                    theta=rope_theta,
                    gemma=gemma,
                    dtype=dtype,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )
        self.final_norm = RMSNorm(D, eps=norm_eps, gemma=gemma, dtype=dtype, rngs=rngs)
        self.lm_head = None if gemma else _param(rngs, (D, vocab_size), ("embed", "vocab"),
                                                 dtype=dtype)  # fmt: skip
        self.gemma, self.softcap = gemma, final_softcap
        # (read by posttrain for its FLOP estimates and context checks)
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.head_dim, self.mlp_dim, self.max_seq_len = head_dim, mlp_dim, max_seq_len

    def hidden_states(self, tokens_BL, positions_BL, segment_ids_BL):
        x_BLD = jnp.take(self.embed[...], tokens_BL, axis=0)
        if self.gemma:
            x_BLD = x_BLD * jnp.sqrt(jnp.asarray(x_BLD.shape[-1], x_BLD.dtype))
        for block in self.layers:
            x_BLD = block(x_BLD, positions_BL, segment_ids_BL)
        return self.final_norm(x_BLD)

    def logits(self, hidden_BLD):
        head_DV = self.embed[...].T if self.gemma else self.lm_head[...]
        logits_BLV = (hidden_BLD @ head_DV).astype(jnp.float32)
        if self.gemma and self.softcap:
            logits_BLV = self.softcap * jnp.tanh(logits_BLV / self.softcap)
        return logits_BLV

    def __call__(self, tokens_BL, positions_BL, segment_ids_BL):
        return self.logits(self.hidden_states(tokens_BL, positions_BL, segment_ids_BL))


def nnx_decoder(*, rngs: nnx.Rngs, **kwargs) -> Decoder:
    """The builder a config names: `model.nnx = "posttrain.testing:nnx_decoder"`."""
    return Decoder(rngs=rngs, **kwargs)
