"""RL as a batch source of the shared train loop: prompts -> rollouts -> rewards -> advantages.

Each RL step is one batch: `data.batch_size` prompt groups sampled with the newest weights
(co-located: the train state's params; decoupled: a `RolloutProducer` thread on the sampler's
devices), scored by the reward registry, then passed through the trainer's old-policy,
reference and critic passes and the advantages (`Scorer`). The loop makes
`algorithm.epochs x algorithm.minibatches` updates from it (`BatchPasses`) and shows the
source each new state (`observe`), which is how the weights reach the sampler.

The source's state, saved with every checkpoint: the prompt stream's position (with the
adaptive domain weights and their RNG) and the KL coefficient. Sampling seeds come from
`(train.seed, step)`, so a resumed run draws and samples what an uninterrupted one would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from posttrain.losses import adaptive_kl_update
from posttrain.parallel import process_rows
from posttrain.rl._config import RLConfig
from posttrain.rl._domains import StabilityMonitor, normalise_by_domain, update_scales
from posttrain.rl._prompts import PromptData
from posttrain.rl._replay import route_shape
from posttrain.rl._rollout import Rollouts, draw_groups
from posttrain.rl._rollout_batch import rollout_batch
from posttrain.rl._rollout_producer import RolloutProducer
from posttrain.rl._sampler_weights import SamplerWeights
from posttrain.rl._scorer import Scorer


def _group_stats(rewards: np.ndarray, lengths: np.ndarray, domains, domain_ids, threshold):
    """Per-domain host metrics of a step's rollouts (rows of real groups)."""
    out = {}
    for d, name in enumerate(domains):
        rows = domain_ids == d
        if rows.any():
            out[f"reward/{name}"] = float(rewards[rows].mean())
            out[f"pass_rate/{name}"] = float((rewards[rows] >= threshold).mean())
            out[f"response_length/{name}"] = float(lengths[rows].mean())
    return out


def _gap_max(batch: dict, mask: np.ndarray) -> dict[str, float]:
    """The largest |trainer old log-prob - sampler log-prob| of the step's sampled tokens (with
    fused old log-probs the update's loss reports it)."""
    if "old_logps" not in batch:
        return {}
    gap = np.abs(batch["old_logps"] - batch["sampler_logps"])[mask]
    return {"logp_gap_max": float(gap.max(initial=0.0))}


def _ratio_extremes(batch: dict, mask: np.ndarray, level: str) -> dict[str, float]:
    """The smallest and largest ratio p_old / p_sampler of the step's sampled tokens, and with a
    sequence-level correction of its rows (the means are the loss's `is_ratio`)."""
    if level == "off" or not mask.any():
        return {}
    log_r = np.where(mask, batch["old_logps"] - batch["sampler_logps"], 0.0).clip(-20, 20)
    out = {
        "is_ratio_min": float(np.exp(log_r[mask].min())),
        "is_ratio_max": float(np.exp(log_r[mask].max())),
    }
    if level != "token":
        rows = mask.any(axis=1)
        log_R = log_r.sum(axis=1)[rows]
        if level == "geometric":
            log_R = log_R / mask.sum(axis=1)[rows]
        out.update(
            is_seq_ratio_min=float(np.exp(log_R.min())), is_seq_ratio_max=float(np.exp(log_R.max()))
        )
    return out


class RolloutSource:
    """This process's RL batches, one per step, for `train_loop` (see the module docstring).

    With several processes, each one draws the same prompts and holds the whole step's
    rollouts (it samples its share, `Rollouts.sample`), so the host metrics are the global
    ones on every process; it returns its own rows of the global batch.

    Args:
      c: the run's config.
      prompts: the training prompts (its position is part of this source's state).
      rollouts: samples and scores co-located batches; its `max_len` and tokenizer lay out rows.
      sampler: the sampler's weights from the trained params.
      score: the trainer's passes over a rollout batch (adds log-probs, advantages...).
      producer: decoupled rollouts: `start step -> RolloutProducer`, made when the loop shows
        the starting state; None samples co-located.
    """

    def __init__(
        self,
        c: RLConfig,
        prompts: PromptData,
        rollouts: Rollouts,
        sampler: SamplerWeights,
        score: Scorer,
        producer: Callable[[int], RolloutProducer] | None = None,
    ):
        self.c, self.prompts, self.rollouts = c, prompts, rollouts
        self.sampler, self.score, self._make_producer = sampler, score, producer
        self.producer: RolloutProducer | None = None
        self.kl_coef = c.kl.coef
        self._kl = None  # the last step's device `kl`, folded into kl_coef when next needed
        self._params, self._step = None, 0
        self._prompt_state = None  # decoupled: the prompt position after the last batch drawn
        self._metrics: dict[str, float] = {}
        m = c.monitor
        self.monitor = StabilityMonitor(m.entropy_collapse, m.kl_max, m.warmup)

    @property
    def stats(self) -> dict:
        return self.prompts.stats

    def observe(self, step: int, state, metrics: dict | None) -> None:
        """The loop's state after `step` (its starting state when `metrics` is None)."""
        self._params, self._step = state.params, step
        if metrics is not None and self.c.kl.target > 0:
            self._kl = metrics.get("kl")
        if self._make_producer is None:
            return
        if self.producer is None:
            self.producer = self._make_producer(step)
            self.producer.start(state.params, step)
        else:
            self.producer.publish(state.params, step)

    def _settle_kl(self) -> None:
        """Ziegler et al.'s adaptive KL controller, on the last step's mean KL."""
        if self._kl is None:
            return
        kl, self._kl = float(jax.device_get(self._kl)), None
        if np.isfinite(kl):  # (a skipped, non-finite step leaves the coefficient alone)
            c = self.c.kl
            update = adaptive_kl_update(
                self.kl_coef, kl, target=c.target, horizon=c.horizon, n_steps=1
            )
            self.kl_coef = float(update)

    def __iter__(self) -> RolloutSource:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        c, step = self.c, self._step + 1
        t_train = time.perf_counter()
        jax.block_until_ready(self._params)  # (sampling and the trainer's passes need them)
        self._settle_kl()
        t0 = time.perf_counter()
        if self.producer is None:
            weights = self.sampler(self._params)
            kept, completions, rewards, counts = draw_groups(
                c, self.prompts, self.rollouts, weights, step
            )
        else:
            kept, completions, rewards, counts, self._prompt_state = self.producer.get(step)
        t1 = time.perf_counter()
        batch = rollout_batch(
            kept,
            completions,
            rewards,
            groups=c.data.batch_size,
            max_len=self.rollouts.max_len,
            pad_id=self.rollouts.tokenizer.pad_id or 0,
            route_shape=route_shape(c.loss.router_replay, self.rollouts.model_config),
            images=self.rollouts.images,
        )
        scored = self.score(self._params, batch, self.kl_coef)  # (every process: the whole batch)
        if c.domains.normalise_advantages:
            batch["advantages"] = normalise_by_domain(
                batch["advantages"], batch["domain_ids"], batch["loss_mask"]
            )
        if c.domains.lr_scale:
            batch["update_scale"] = update_scales(
                batch["domain_ids"], self.prompts.domains, c.domains.lr_scale
            )
        real = batch["domain_ids"] >= 0
        mask = batch["loss_mask"] > 0
        threshold = c.rewards.pass_threshold
        metrics = {
            "reward": float(batch["rewards"][real].mean()),
            "reward_std": float(batch["rewards"][real].std()),
            "pass_rate": float((batch["rewards"][real] >= threshold).mean()),
            "response_length": float(batch["lengths"][real].mean()),
            "truncated": float(batch["truncated"][real].mean()),
            **_gap_max(batch, mask),
            **_ratio_extremes(batch, mask, c.loss.correction),
            "groups": float(len(kept)),
            # (grouped domain updates: 1, every update of the step sees one domain)
            "domains_in_batch": float(len(np.unique(batch["domain_ids"][real]))),
            **counts,  # with decoupled rollouts: rollout_version and staleness
            **_group_stats(
                batch["rewards"][real],
                batch["lengths"][real],
                self.prompts.domains,
                batch["domain_ids"][real],
                threshold,
            ),
            "kl_coef": self.kl_coef,
            **scored,  # the trainer's passes' own (distill/reverse_kl)
            # generate_s and reward_s come with the rollouts (counts); with decoupled
            # rollouts they overlap training, and wait_s is what the trainer waited.
            "wait_s": t1 - t0,
            "prepare_s": time.perf_counter() - t1,  # the trainer's passes, advantages
            # What this step waited for the previous step's updates (a step late: the loop
            # does not wait on the device).
            "train_s": t0 - t_train,
        }
        if c.domains.adaptive:
            # A group carries learning signal when its rewards differ.
            signal: dict[str, list[float]] = {}
            for p, group in zip(kept, rewards, strict=True):
                signal.setdefault(p["domain"], []).append(float(np.ptp(group) > 0))
            self.prompts.update_signal({d: float(np.mean(v)) for d, v in signal.items()})
            weights = self.prompts.domain_weights
            metrics.update({f"domain_weight/{d}": w for d, w in weights.items()})
        self._metrics = metrics
        if jax.process_count() == 1:
            return batch
        rows = process_rows(len(batch["rewards"]), self.score.mesh)
        return {k: v[rows] for k, v in batch.items()}  # this process's rows of the global batch

    def watch(self, step: int, metrics: dict) -> dict[str, float]:
        """Stability alerts from the step's metrics (`StabilityMonitor`)."""
        return self.monitor(step, metrics)

    def batch_metrics(self) -> dict[str, float]:
        """Host metrics of the batch last drawn."""
        return self._metrics

    def get_state(self) -> dict[str, Any]:
        self._settle_kl()
        return {
            "prompts": self._prompt_state or self.prompts.get_state(),
            "kl_coef": self.kl_coef,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.prompts.set_state(state["prompts"])
        self.kl_coef = float(state["kl_coef"])

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
