"""The one configuration dataclass that describes every supported decoder."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from posttrain.models._components import ROPE_TYPES, MLAConfig, MoEConfig, RopeScaling, VisionConfig
from posttrain.models._nnx import NNXSpec, nnx_num_params

ATTENTION_IMPLS = ("auto", "xla", "flash", "cudnn", "splash")
PIPELINE_REMAT = ("layers", "stage")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen) | GeGLU with tanh GELU (Gemma)
CONTEXT_PARALLEL = ("ring", "all_gather")


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
    # Mixture of experts: layers first_k_dense.. replace their SwiGLU by routed experts.
    moe: MoEConfig | None = None
    first_k_dense: int = 0  # with moe: leading layers that keep the dense SwiGLU (mlp_dim)
    # Multi-head latent attention instead of q/k/v projections (num_kv_heads = num_heads and
    # head_dim = qk_nope_head_dim + qk_rope_head_dim are then implied; set them so).
    mla: MLAConfig | None = None
    tie_embeddings: bool = False  # lm_head shares the input embedding
    # Gemma 2/3. Norms scale by (norm_offset + weight), in float32 (Gemma: 1, weights start
    # at 0); post_norms adds a norm on the attention and MLP outputs before each residual add;
    # embed_scale multiplies the embeddings by sqrt(embed_dim) (in the compute dtype).
    norm_offset: float = 0.0
    post_norms: bool = False
    embed_scale: bool = False
    mlp_activation: str = "silu"  # the gate's activation, one of MLP_ACTIVATIONS
    attn_scale: float | None = None  # multiplies q.k; None: head_dim**-0.5
    attn_softcap: float = 0.0  # > 0: scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float = 0.0  # > 0: the same on the vocabulary logits (Gemma 2)
    # Gemma 3: sliding-window layers rotate by plain RoPE of this base; full layers keep
    # rope_theta and rope_scaling. None: every layer alike.
    rope_local_theta: float | None = None
    param_dtype: str = "float32"  # storage dtype of the weights
    compute_dtype: str = "float32"  # matmul/activation dtype; "bfloat16" for speed
    remat: str = "none"  # rematerialisation policy per layer, one of REMAT_POLICIES
    attention: str = "auto"  # one of ATTENTION_IMPLS; auto = cudnn on GPU, splash on TPU
    # Losses compute the vocabulary logits this many positions of each row at a time, never
    # all `[B, L, V]` at once (posttrain.losses.token_stats); 0: the whole row at once.
    logits_chunk: int = 0
    # With the rows' length sharded (mesh `sequence` axis): "ring" passes key/value shards
    # around the devices, "all_gather" gathers them once per layer (posttrain.models._context).
    context_parallel: str = "ring"
    # With mesh stage > 1: microbatches per pipelined forward (GPipe; 0: one per stage). More
    # shrink the bubble, (stages - 1) / (microbatches + stages - 1) of the step.
    pipeline_microbatches: int = 0
    # With mesh stage > 1, what the backward keeps per microbatch: "layers" what each layer's
    # `remat` policy saves, "stage" only the stage's input (its layers rerun in the backward,
    # one microbatch at a time; posttrain.models._pipeline).
    pipeline_remat: str = "layers"
    # With mesh stage > 1, the order of the microbatches' passes: "gpipe" every forward, then
    # every backward; "1f1b" a forward and a backward per tick, so a stage keeps at most
    # 2 x stages - 1 microbatches' residuals instead of all of them (losses that give their
    # rest per row group: SFT and the DPO family; posttrain.models._pipeline).
    pipeline_schedule: str = "gpipe"
    # Batch-invariant (zero-mismatch) mode: every per-token step in fixed 16-row tiles and
    # attention over 16-key blocks in a fixed order, so a token's log-prob has the same bits
    # in the trainer's pass, a prefill and a decode step (posttrain.models._invariant). Slower.
    batch_invariant: bool = False
    name: str = "custom"  # preset or HF model name, for logs
    # A Flax NNX module instead of the decoder these fields describe (posttrain.models._nnx);
    # the fields above then only record its vocabulary, width and sizes.
    nnx: NNXSpec | None = None
    # An image encoder whose features replace the image tokens (a VLM); None: text only.
    vision: VisionConfig | None = None

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
        if self.context_parallel not in CONTEXT_PARALLEL:
            fail(f"context_parallel={self.context_parallel!r}; choose one of {CONTEXT_PARALLEL}")
        if self.pipeline_microbatches < 0:
            fail(f"pipeline_microbatches={self.pipeline_microbatches} must be >= 0")
        if self.pipeline_remat not in PIPELINE_REMAT:
            fail(f"pipeline_remat={self.pipeline_remat!r}; choose one of {PIPELINE_REMAT}")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            fail(
                f"pipeline_schedule={self.pipeline_schedule!r}; choose one of {PIPELINE_SCHEDULES}"
            )
        if self.logits_chunk < 0:
            fail(f"logits_chunk={self.logits_chunk} must be >= 0 (0: no chunking)")
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
        if self.first_k_dense and self.moe is None:
            fail("first_k_dense is only meaningful with moe; set model.moe or first_k_dense=0")
        if not 0 <= self.first_k_dense < self.num_layers:
            fail(f"first_k_dense={self.first_k_dense} must be in 0..{self.num_layers - 1}")
        if self.mla is not None:
            if self.num_kv_heads != self.num_heads or self.head_dim != self.mla.qk_head_dim:
                fail(
                    f"with mla, num_kv_heads must equal num_heads ({self.num_heads}) and "
                    f"head_dim must be qk_nope_head_dim + qk_rope_head_dim "
                    f"({self.mla.qk_head_dim})"
                )
            if self.qkv_bias or self.o_bias or self.qk_norm:
                fail("mla has no qkv_bias, o_bias or qk_norm; turn them off")
            if self.sliding_window is not None:
                fail("mla with sliding windows is not supported")
        if self.batch_invariant:
            if self.mla is not None:
                fail("batch_invariant does not support MLA yet; set batch_invariant=False")
            if self.moe is not None and self.moe.dispatch != "dropless":
                fail("batch_invariant needs moe.dispatch='dropless' (capacity varies by batch)")
            if self.attention not in ("auto", "xla"):
                fail(
                    f"batch_invariant has its own attention: set attention='auto', not "
                    f"{self.attention!r}"
                )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            fail(f"mlp_activation={self.mlp_activation!r}; choose one of {MLP_ACTIVATIONS}")
        if self.rope_local_theta is not None and self.rope_local_theta <= 0:
            fail(f"rope_local_theta must be positive or None, got {self.rope_local_theta}")
        if self.norm_offset not in (0.0, 1.0):
            fail(f"norm_offset must be 0 or 1 (Gemma), got {self.norm_offset}")
        if self.attn_softcap < 0 or self.final_softcap < 0:
            fail("attn_softcap and final_softcap must be >= 0 (0: off)")
        if self.attn_scale is not None and self.attn_scale <= 0:
            fail(f"attn_scale must be positive or None, got {self.attn_scale}")
        gemma = (
            self.norm_offset or self.post_norms or self.attn_softcap or self.attn_scale
            or self.rope_local_theta
        )  # fmt: skip
        if gemma and (self.mla is not None or self.batch_invariant):
            fail(
                "norm_offset, post_norms, attn_scale, attn_softcap and rope_local_theta "
                "(Gemma) run without mla and batch_invariant"
            )
        if self.vision is not None:
            if self.nnx is not None or self.batch_invariant or self.mla is not None:
                fail("a vision encoder runs with the decoder alone (no nnx, mla, batch_invariant)")
            if not 0 <= self.vision.image_token_id < self.vocab_size:
                fail(f"image_token_id={self.vision.image_token_id} is outside the vocabulary")
        if self.attn_softcap and self.attention in ("cudnn",):
            fail("attention='cudnn' has no logit soft-capping; set attention='auto' or 'xla'")
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
    def scale(self) -> float:
        """What attention multiplies q.k by."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.moe else 0

    def cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dims, value dims) of one cached token per layer. MLA caches its latent
        plus the shared rope key as one "head", and no separate value (it is the latent)."""
        if self.mla:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim

    def flops_per_token(self, seq_len: int, lm_head: bool = True) -> float:
        """Training FLOPs per token (forward + backward): 6 x active matmul params + causal
        attention. For MoE only the experts a token is routed to (plus shared ones) count.
        `lm_head=False`: a reward model's trunk, which never computes the vocabulary logits
        (its few scalar heads are left out). An NNX module: 6 x its parameters (its attention
        is not known)."""
        if self.nnx is not None:
            return 6.0 * nnx_num_params(self.nnx)
        D, N = self.embed_dim, self.num_heads
        if self.mla:
            m = self.mla
            q = D * N * m.qk_head_dim
            if m.q_lora_rank:
                q = D * m.q_lora_rank + m.q_lora_rank * N * m.qk_head_dim
            kv = D * (m.kv_lora_rank + m.qk_rope_head_dim)
            kv += m.kv_lora_rank * N * (m.qk_nope_head_dim + m.v_head_dim)
            attn = q + kv + N * m.v_head_dim * D
        else:
            attn = D * (N + 2 * self.num_kv_heads) * self.head_dim + N * self.head_dim * D
        dense_mlp = 3 * D * self.mlp_dim
        mlp = self.num_layers * dense_mlp
        if self.moe:
            e = self.moe
            active = (e.top_k + e.num_shared_experts) * 3 * D * e.expert_mlp_dim
            routed = self.num_moe_layers * (active + D * e.num_experts)  # + the router
            mlp = self.first_k_dense * dense_mlp + routed
        matmul_params = self.num_layers * attn + mlp + (D * self.vocab_size if lm_head else 0)
        # Causal QK^T and AV: half of 2*L*N*(qk + v) multiply-adds per token, x3 with backward.
        attention = 3 * self.num_layers * N * (self.head_dim + self.v_head_dim) * seq_len
        return 6 * matmul_params + attention
