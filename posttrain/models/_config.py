"""The one configuration dataclass that describes every supported decoder."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Position-interpolation settings (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # context extension factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low are fully scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high are kept
    original_max_position_embeddings: int = 8192  # llama3: pre-extension context


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: Llama 3.x, Qwen2/2.5, Qwen3 and Mistral are settings of it."""

    vocab_size: int  # V
    embed_dim: int  # D, the residual stream width
    num_layers: int  # T, stacked and scanned
    num_heads: int  # N, query heads
    num_kv_heads: int  # K, key/value heads (GQA when K < N)
    head_dim: int  # H
    mlp_dim: int  # F, SwiGLU hidden width
    max_seq_len: int = 4096  # longest position the model was trained for
    rope_theta: float = 10_000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # None means plain RoPE
    norm_eps: float = 1e-6  # RMSNorm epsilon
    qkv_bias: bool = False  # Qwen2/2.5: bias on q, k and v projections
    o_bias: bool = False  # Llama `attention_bias=True`: bias on the output projection too
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # keys within this many positions (incl. self)
    # Which layers use `sliding_window`; None means every layer (Mistral). Qwen-style
    # mixes list the indices of the sliding layers.
    sliding_window_layers: tuple[int, ...] | None = None
    tie_embeddings: bool = False  # lm_head shares the input embedding
    param_dtype: str = "float32"  # storage dtype of the weights
    compute_dtype: str = "float32"  # matmul/activation dtype; "bfloat16" for speed
    remat: str = "none"  # rematerialisation policy per layer, one of REMAT_POLICIES
    attention: str = "auto"  # one of ATTENTION_IMPLS; auto = cudnn on GPU, splash on TPU
    name: str = "custom"  # preset or HF model name, for logs

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"Invalid model config {self.name!r}: {msg}")

        for field in (
            "vocab_size",
            "embed_dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
        ):
            if getattr(self, field) <= 0:
                fail(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            fail(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.attention not in ATTENTION_IMPLS:
            fail(f"attention={self.attention!r}; choose one of {ATTENTION_IMPLS}")
        if self.remat not in REMAT_POLICIES:
            fail(f"remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        for field in ("param_dtype", "compute_dtype"):
            try:
                jnp.dtype(getattr(self, field))
            except TypeError:
                fail(
                    f"{field}={getattr(self, field)!r} is not a dtype name "
                    "(use float32 or bfloat16)"
                )
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ROPE_TYPES:
            fail(
                f"rope_scaling type {self.rope_scaling.rope_type!r} is not supported; "
                f"supported: {ROPE_TYPES}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            fail(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.sliding_window_layers is not None:
            bad = [i for i in self.sliding_window_layers if not 0 <= i < self.num_layers]
            if bad:
                fail(f"sliding_window_layers {bad} are outside 0..{self.num_layers - 1}")

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Attention window of each layer; 0 means full causal attention."""
        if self.sliding_window is None:
            return (0,) * self.num_layers
        if self.sliding_window_layers is None:
            return (self.sliding_window,) * self.num_layers
        sliding = set(self.sliding_window_layers)
        return tuple(self.sliding_window if i in sliding else 0 for i in range(self.num_layers))

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 x matmul params + causal attention."""
        per_layer = self.embed_dim * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer += (
            self.num_heads * self.head_dim * self.embed_dim + 3 * self.embed_dim * self.mlp_dim
        )
        matmul_params = self.num_layers * per_layer + self.embed_dim * self.vocab_size
        attention = 6 * self.num_layers * self.num_heads * self.head_dim * seq_len  # QK^T, AV
        return 6 * matmul_params + attention

    def num_params(self) -> int:
        """Parameter count, from shapes alone."""
        from posttrain.models._transformer import param_shapes

        return sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(self)))
