"""On-policy distillation's per-token advantage (Agarwal et al. 2024, GKD on-policy with the
reverse KL; Thinking Machines, "On-policy distillation", 2025).

The student samples; a teacher scores each sampled token. The per-token reward is the negated
one-sample estimate of the reverse KL, `teacher_logp - student_logp` (the `k1` estimator of
KL(student || teacher) with the sign flipped), with discount 0: a token's advantage is its own
reward, not the sum of later ones. Fed to the clipped policy-gradient loss, its expected
gradient is that of the reverse KL, so the student moves toward the teacher on the prefixes it
visits itself. A task reward's advantage may be mixed in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.losses._rl import kl_estimate


def distill_advantages(
    student_logp_BL: jax.Array,
    teacher_logp_BL: jax.Array,
    mask_BL: jax.Array,
    advantages: jax.Array,
    *,
    coef: float = 1.0,
    reward_coef: float = 0.0,
) -> jax.Array:
    """Per-token advantages `coef (teacher_logp - student_logp) + reward_coef A`.

    Args:
      student_logp_BL: log-probs of the sampled tokens under the student (the sampling policy).
      teacher_logp_BL: the same tokens' log-probs under the teacher.
      mask_BL: 1 on sampled (trained) tokens.
      advantages: the task reward's advantages, `[B]` (one per sequence, broadcast over its
        tokens) or `[B, L]`.
      coef: weight of the distillation term.
      reward_coef: weight of the task advantage (0: pure distillation).

    Returns:
      float32 `[B, L]`, 0 off the mask whatever the inputs hold there.
    """
    mask = mask_BL > 0
    reverse_kl = kl_estimate(student_logp_BL, teacher_logp_BL, "k1", mask_BL)
    task = advantages[:, None] if advantages.ndim == 1 else advantages
    return jnp.where(mask, reward_coef * task - coef * reverse_kl, 0.0).astype(jnp.float32)
