"""The trainer's passes over a rollout batch before its updates (old-policy and reference
log-probs, critic values, KL penalty, advantages)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from posttrain.lora import wrap
from posttrain.losses import distill_advantages, gae, group_advantages, kl_estimate, whiten
from posttrain.parallel import process_rows, shard_batch
from posttrain.rl._config import RLConfig
from posttrain.rl._critic import token_values
from posttrain.rl._loss import sequence_log_probs
from posttrain.rl._replay import replay_kwargs
from posttrain.rl._shares import host_array


def policy_params(c: RLConfig, params):
    """The policy's params inside the trained params (PPO also trains a critic): with LoRA,
    its adapters."""
    return params["policy"] if c.ppo else params


class Scorer:
    """The trainer's passes over a rollout batch before its updates: the old policy's and the
    reference's log-probs of the sampled tokens, the critic's values, the KL penalty when it
    is a reward, and the advantages (group-relative, or GAE with the critic; with a
    distillation `teacher`, per token: `posttrain.rl._teacher`)."""

    def __init__(
        self, c: RLConfig, model_config, critic, ref_params, mesh, domains, base=None, teacher=None
    ):
        self.c, self.model_config, self.critic = c, model_config, critic
        self.ref_params, self.mesh, self.base = ref_params, mesh, base
        self.teacher = teacher
        self.scale = np.asarray([c.kl.domain_scale.get(d, 1.0) for d in domains] + [0.0])

        def logps(trained, base, batch, adapters=True):
            params, kwargs = wrap(c.lora, base, trained, adapters=adapters)
            kwargs = {**kwargs, **replay_kwargs(c.loss.router_replay != "off", batch)}
            return sequence_log_probs(params, model_config, batch, **kwargs)

        # (with LoRA: the reference is the base with the adapters off)
        self.logps = jax.jit(logps, static_argnames="adapters")
        if critic is not None:
            self.values = jax.jit(token_values, static_argnums=1)
            a = c.algorithm
            self.gae = jax.jit(functools.partial(gae, gamma=a.gamma, lam=a.lam))

    def __call__(self, params, batch: dict, kl_coef: float) -> dict[str, float]:
        """Adds `old_logps`, `ref_logps`, `kl_coefs`, `advantages` (and with a critic
        `old_values`, `returns`) to the host batch (the whole step's, on every process: each
        feeds its own rows and gets every row's results back); returns host metrics of these
        passes (with a teacher: `distill/reverse_kl`)."""
        c = self.c
        rows = process_rows(len(batch["rewards"]), self.mesh)
        device_batch = shard_batch({k: v[rows] for k, v in batch.items()}, self.mesh)
        policy = policy_params(c, params)
        if not c.fused_old_logps:  # (else the update's forward computes them)
            batch["old_logps"] = host_array(self.logps(policy, self.base, device_batch))
        batch["kl_coefs"] = (kl_coef * self.scale[batch["domain_ids"]]).astype(np.float32)
        mask = batch["loss_mask"]
        penalty = np.zeros_like(mask)
        if c.kl.enabled:
            if c.lora is None:
                ref = self.logps(self.ref_params, None, device_batch)
            else:
                ref = self.logps(None, self.base, device_batch, adapters=False)
            batch["ref_logps"] = host_array(ref)
            if c.kl.mode == "reward":
                kl = kl_estimate(batch["old_logps"], batch["ref_logps"], c.loss.kl_estimator, mask)
                penalty = batch["kl_coefs"][:, None] * np.asarray(kl)
        if self.critic is None:
            # Within each prompt's group (fillers: all-zero groups, advantage 0).
            rewards = batch["rewards"] - penalty.sum(axis=1)
            batch["advantages"] = np.asarray(
                group_advantages(
                    rewards,
                    c.rollout.num_generations,
                    mode=c.algorithm.advantage,
                    unbiased_std=c.algorithm.unbiased_std,
                    std_eps=c.algorithm.std_eps,
                ),
                np.float32,
            )
            return self._distill(batch, device_batch)
        values = host_array(self.values(params["value"], self.critic.model_config, device_batch))
        # The outcome reward lands on each completion's last token, the KL penalty on every one.
        token_rewards = -penalty
        rows = np.flatnonzero(mask.any(axis=1))
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1] > 0, axis=1)
        token_rewards[rows, last[rows]] += batch["rewards"][rows]
        advantages, returns = self.gae(token_rewards, values, mask)
        if c.algorithm.whiten_advantages:
            advantages = whiten(advantages, mask)
        batch["advantages"] = np.asarray(advantages, np.float32)
        batch["returns"] = np.asarray(returns, np.float32)
        batch["old_values"] = (values * mask).astype(np.float32)
        return self._distill(batch, device_batch)

    def _distill(self, batch: dict, device_batch: dict) -> dict[str, float]:
        """With a teacher: per-token advantages `[B, L]` from its log-probs of the sampled
        tokens (the task advantage mixed in by `distill.reward_coef`), and the step's mean
        reverse KL estimate `student_logp - teacher_logp` over those tokens."""
        if self.teacher is None:
            return {}
        d, mask = self.c.distill, batch["loss_mask"]
        teacher = self.teacher.logps(batch, device_batch)
        batch["advantages"] = np.asarray(
            distill_advantages(
                batch["old_logps"],
                teacher,
                mask,
                batch["advantages"],
                coef=d.coef,
                reward_coef=d.reward_coef,
            ),
            np.float32,
        )
        on = mask > 0
        reverse_kl = (batch["old_logps"] - teacher)[on].mean() if on.any() else 0.0
        return {"distill/reverse_kl": float(reverse_kl)}
