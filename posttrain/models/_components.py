"""The optional parts of a decoder's config (`ModelConfig` fields): RoPE scaling, a vision
tower, mixture-of-experts layers and multi-head latent attention."""

from __future__ import annotations

import dataclasses

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
