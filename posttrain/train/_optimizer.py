"""AdamW with warmup and decay, global-norm clipping, weight decay on matrices only."""

from __future__ import annotations

import dataclasses

import jax
import optax

SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4  # peak learning rate, reached after warmup
    warmup_steps: int = 0  # linear warmup from 0
    schedule: str = "cosine"  # decay after warmup: cosine | linear | constant
    end_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    weight_decay: float = 0.0  # decoupled (AdamW), applied to weight matrices only
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping threshold; 0 disables
    # Adam's first moment kept in this dtype ("": the params'); "bfloat16" saves a quarter of
    # float32 params' optimizer state (the second moment stays in the params' dtype).
    mu_dtype: str = ""

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"optimizer.schedule={self.schedule!r}; choose one of {', '.join(SCHEDULES)}"
            )
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("optimizer.learning_rate must be > 0, warmup_steps and grad_clip >= 0")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1) or self.eps <= 0:
            raise ValueError("optimizer.b1 and optimizer.b2 must be in [0, 1), optimizer.eps > 0")
        if self.mu_dtype not in ("", "bfloat16", "float32"):
            raise ValueError(
                f"optimizer.mu_dtype={self.mu_dtype!r}; choose '' (the params' dtype), "
                "bfloat16 or float32"
            )
        if not 0 <= self.end_lr_ratio <= 1 or self.weight_decay < 0:
            raise ValueError(
                "optimizer.end_lr_ratio must be in [0, 1] and optimizer.weight_decay >= 0"
            )


def learning_rate_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to the peak, then the configured decay over the remaining steps."""
    peak, warmup = config.learning_rate, config.warmup_steps
    decay_steps = max(total_steps - warmup, 1)
    end = peak * config.end_lr_ratio
    if config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.end_lr_ratio)
    elif config.schedule == "linear":
        decay = optax.linear_schedule(peak, end, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(
    config: OptimizerConfig, total_steps: int, decay_mask=None, frozen=None
) -> optax.GradientTransformation:
    """The optax chain. `decay_mask` is a pytree of bools (True = apply weight decay); `frozen`
    one marking the params held fixed (no update, no optimizer state, left out of the clipped
    norm)."""
    parts = []
    if config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip))
    parts.append(
        optax.adamw(
            learning_rate_schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
            mu_dtype=config.mu_dtype or None,
        )
    )
    chain = optax.chain(*parts)
    if frozen is None:
        return chain
    labels = jax.tree.map(lambda f: "frozen" if f else "trained", frozen)
    return optax.multi_transform({"trained": chain, "frozen": optax.set_to_zero()}, labels)
