"""The one configuration dataclass that describes every supported decoder."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from posttrain.models._nnx import NNXSpec, nnx_num_params

ATTENTION_IMPLS = ("auto", "xla", "flash", "cudnn", "splash")
PIPELINE_REMAT = ("layers", "stage")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama, Qwen) | GeGLU with tanh GELU (Gemma)
CONTEXT_PARALLEL = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Position-interpolation settings (HF `rope_scaling` / `rope_parameters`)."""

    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # context extension factor
    low_freq_factor: float = 1.0  # llama3: wavelengths above orig/low are fully scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below orig/high are kept
    original_max_position_embeddings: int = 8192  # llama3, yarn: pre-extension context
    # yarn (DeepSeek-V3, Kimi K2), HF's names and defaults. Dimensions that turn more than
    # `beta_fast` times over the original context keep their frequency, those that turn fewer
    # than `beta_slow` times are divided by `factor`, a linear ramp in between.
    beta_fast: float = 32.0  # yarn: rotations where interpolation starts
    beta_slow: float = 1.0  # yarn: rotations where interpolation is complete
    mscale: float | None = None  # yarn: with mscale_all_dim, cos/sin get m(mscale)/m(all_dim)
    mscale_all_dim: float | None = None  # yarn: see mscale (DeepSeek-V3 also scales softmax)
    truncate: bool = True  # yarn: round the ramp's ends out to whole dimensions
    attention_factor: float | None = None  # yarn: cos/sin multiplier; None = from factor, mscale

    def __post_init__(self):
        if self.rope_type != "yarn":
            return
        for field in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if getattr(self, field) <= 0:
                raise ValueError(
                    f"Invalid rope_scaling: yarn needs {field} > 0, got {getattr(self, field)}"
                )


PROJECTORS = ("gemma3", "mlp")  # Gemma 3: pool, norm, project | LLaVA: Linear-GELU-Linear


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A SigLIP-style ViT image encoder and the projector that turns its patches into the
    decoder's image-token embeddings (Gemma 3, LLaVA-style VLMs).

    Images arrive as float pixels `[I, image_size, image_size, channels]`, already resized and
    normalised (`posttrain.data.preprocess_images`); the text holds `tokens_per_image` copies of
    `image_token_id` for each, which the projected features replace in order.
    """

    image_size: int  # square input side, pixels
    patch_size: int  # square patch side; (image_size / patch_size)**2 patches per image
    width: int  # the encoder's hidden size
    mlp_dim: int  # its MLP width (GELU, tanh approximation)
    num_layers: int
    num_heads: int
    tokens_per_image: int  # image tokens in the text per image
    image_token_id: int  # the placeholder token the features replace
    channels: int = 3
    norm_eps: float = 1e-6  # the encoder's LayerNorms
    projector: str = "gemma3"  # one of PROJECTORS
    # The projector reads the last layer's output after a final LayerNorm (Gemma 3) or without
    # it (LLaVA, whose `vision_feature_layer` -k becomes num_layers less k - 1 layers).
    final_norm: bool = True
    drop_first_patch: bool = False  # LLaVA's "default" feature strategy (a CLS-token habit)
    projector_bias: bool = True  # mlp projector's biases
    # Image tokens of one image see each other both ways (Gemma 3); else causal like text.
    bidirectional: bool = False
    # The processor's normalisation, (pixel / 255 - mean) / std per channel.
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # The processor's resize filter to image_size: "bilinear" (Gemma 3) or "bicubic" (SigLIP).
    resample: str = "bilinear"

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"Invalid vision config: {msg}")

        for field in ("image_size", "patch_size", "width", "mlp_dim", "num_layers", "num_heads"):
            if getattr(self, field) <= 0:
                fail(f"{field} must be positive, got {getattr(self, field)}")
        if self.image_size % self.patch_size:
            fail(f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}")
        if self.width % self.num_heads:
            fail(f"width={self.width} is not a multiple of num_heads={self.num_heads}")
        if self.resample not in ("bilinear", "bicubic"):
            fail(f"resample={self.resample!r}; choose 'bilinear' or 'bicubic'")
        if self.projector not in PROJECTORS:
            fail(f"projector={self.projector!r}; choose one of {PROJECTORS}")
        side = self.image_size // self.patch_size
        if self.projector == "gemma3":
            pooled = round(self.tokens_per_image**0.5)
            if pooled * pooled != self.tokens_per_image or side % pooled:
                fail(
                    f"tokens_per_image={self.tokens_per_image} must be a square whose side "
                    f"divides the {side} x {side} patch grid (Gemma 3 pools it)"
                )
        elif self.tokens_per_image != side * side - self.drop_first_patch:
            fail(
                f"tokens_per_image={self.tokens_per_image}: the mlp projector gives one token "
                f"per patch, {side * side - self.drop_first_patch}"
            )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def flops_per_image(self, text_dim: int, *, encoder_trained: bool) -> float:
        """Training FLOPs of one image slot: the encoder's forward (every patch attends to
        every patch), x3 with its backward when it trains, and the projector's (x3). A matmul
        whose input needs no gradient costs x2 (its weights' gradient only): the patch
        embedding (pixels are data), and the projector's first behind a frozen encoder."""
        P, W, M, T = self.num_patches, self.width, self.mlp_dim, self.num_layers
        patch = 2 * P * self.patch_size**2 * self.channels * W
        layers = 2 * P * T * (4 * W * W + 2 * W * M) + 4 * T * P * P * W  # (q, k, v, o, MLP)
        if self.projector == "gemma3":  # pooled to tokens_per_image, then one matmul
            first, rest = 2 * self.tokens_per_image * W * text_dim, 0
        else:  # two layers on every token
            first = 2 * self.tokens_per_image * W * text_dim
            rest = 2 * self.tokens_per_image * text_dim * text_dim
        if encoder_trained:
            return 2 * patch + 3 * (layers + first + rest)
        return patch + layers + 2 * first + 3 * rest


SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCH_MODES = ("dropless", "capacity")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward layer (the routed experts plus any shared experts)."""

    num_experts: int  # E, routed experts
    top_k: int  # K, experts per token
    expert_mlp_dim: int  # F, SwiGLU hidden width of one expert
    num_shared_experts: int = 0  # always-on experts: one dense SwiGLU of width F * this
    score_func: str = "softmax"  # router scores: "softmax" (Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the K selected scores to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed output (DeepSeek-V3: 2.5)
    n_group: int = 1  # expert groups for group-limited routing (1 = off)
    topk_group: int = 1  # groups kept per token, ranked by the sum of their top-2 scores
    # DeepSeek-V3 `e_score_correction_bias`: added to the scores to choose experts, never to
    # their weights; no gradient reaches it, move it with `update_routing_bias`.
    use_routing_bias: bool = False
    dispatch: str = "dropless"  # one of DISPATCH_MODES
    capacity_factor: float = 1.25  # "capacity": slots per expert over the balanced share M*K/E
    # Expert parallelism: slots per destination device over the balanced share m*K/ep (m local
    # tokens); overflow is dropped and counted. None sizes buffers for the worst case,
    # m * min(K, E/ep), so nothing is ever dropped, at ep times the balanced expert work.
    ep_capacity_factor: float | None = None
    # Training moves the routing bias by this much per step towards balance (DeepSeek-V3's
    # gamma, 0.001 in pre-training); 0 keeps it as loaded. Never touched by the optimizer.
    routing_bias_rate: float = 0.0
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss in aux["loss"]
    router_z_loss_coef: float = 0.0  # weight of the router z-loss in aux["loss"]

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"Invalid MoE config: {msg}")

        for field in ("num_experts", "top_k", "expert_mlp_dim", "n_group", "topk_group"):
            if getattr(self, field) <= 0:
                fail(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_shared_experts < 0:
            fail(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.top_k > self.num_experts:
            fail(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            fail(f"score_func={self.score_func!r}; choose one of {SCORE_FUNCS}")
        if self.dispatch not in DISPATCH_MODES:
            fail(f"dispatch={self.dispatch!r}; choose one of {DISPATCH_MODES}")
        if self.capacity_factor <= 0:
            fail(f"capacity_factor must be positive, got {self.capacity_factor}")
        if self.ep_capacity_factor is not None and self.ep_capacity_factor <= 0:
            fail(f"ep_capacity_factor must be positive or None, got {self.ep_capacity_factor}")
        if self.routing_bias_rate < 0 or (self.routing_bias_rate and not self.use_routing_bias):
            fail("routing_bias_rate must be >= 0, and needs use_routing_bias=True")
        if self.num_experts % self.n_group:
            fail(f"num_experts={self.num_experts} must be a multiple of n_group={self.n_group}")
        if self.topk_group > self.n_group:
            fail(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            fail(
                f"top_k={self.top_k} exceeds the {self.topk_group} kept group(s) of "
                f"{self.num_experts // self.n_group} experts; raise topk_group or lower top_k"
            )


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values come from one
    low-rank latent per token (the only thing a KV cache stores), queries optionally from
    another; each head's query/key is a `nope` part plus a `rope` part, and the rope part of
    the key is one vector shared by all heads."""

    kv_lora_rank: int  # width of the key/value latent
    qk_nope_head_dim: int  # per-head query/key dims without position
    qk_rope_head_dim: int  # per-head query dims with RoPE; the key's is shared by all heads
    v_head_dim: int  # per-head value dims
    q_lora_rank: int | None = None  # width of the query latent; None: a direct projection

    def __post_init__(self):
        for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Invalid MLA config: {field} must be positive")
        if self.qk_rope_head_dim % 2:
            raise ValueError("Invalid MLA config: qk_rope_head_dim must be even (RoPE pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError("Invalid MLA config: q_lora_rank must be positive or None")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
