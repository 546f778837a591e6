"""The RL loop (GRPO family): prompts -> rollouts -> rewards -> advantages -> policy updates.

One RL step:
  1. draws `data.batch_size` prompts and samples `rollout.num_generations` completions of each
     with the current weights (co-located: the sampler reads the train state's params; with
     LoRA, the frozen base with the adapters merged in);
  2. scores them with the reward registry (verifiers in a killable worker pool, `rm:` reward
     models in this process) and, with dynamic sampling (DAPO), drops groups whose rewards are
     all equal and draws more prompts to refill;
  3. computes the trainer's own log-probs of the sampled tokens (old policy) and the frozen
     reference's, logs the sampler/trainer gap, and the group advantages;
  4. runs `algorithm.epochs` x `algorithm.minibatches` optimizer updates with the shared
     `train_step` and the clipped policy loss.
Checkpoints hold the train state, the prompt stream's position and the KL controller; the
reference is the starting weights, reloaded from `model.*` on resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.losses import adaptive_kl_update
from posttrain.parallel import MeshConfig, axis_rules, make_mesh, shard_batch
from posttrain.rewards import (
    RewardPool,
)
from posttrain.rl._config import RLConfig
from posttrain.rl._critic import value_trainable
from posttrain.rl._loss import CriticLoss, rl_loss
from posttrain.rl._offline import filter_by_difficulty, rejection_sampling
from posttrain.rl._prompts import AdaptiveDomains, PromptData
from posttrain.rl._rollout import (
    RolloutProducer,
    Rollouts,
    SamplerWeights,
    draw_groups,
    rollout_batch,
    split_rows,
)
from posttrain.rl._scorer import Scorer
from posttrain.train._checkpoint import Checkpointer
from posttrain.train._loop import _Preemption
from posttrain.train._lora import base_inputs, lora_json, lora_trainable
from posttrain.train._metrics import MetricsWriter
from posttrain.train._optimizer import learning_rate_schedule
from posttrain.train._run import (
    Trainable,
    model_trainable,
    optimizer_and_abstract_state,
    setup,
    to_json,
    with_shardings,
)
from posttrain.train._state import create_state, state_shardings
from posttrain.train._step import train_step

log = logging.getLogger(__name__)


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


def run_rl(config: RLConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) a GRPO-family run in `workdir`; returns a summary.

    Returns:
      {"final_step", "stopped", "train" (last metrics), "eval" (last eval), "state",
      "model_config", "data" (prompt stats)}.
    """
    if jax.process_count() > 1:
        raise ConfigError(
            "RL runs in one process for now (SFT, DPO and reward models run on several); "
            "run it on one host"
        )
    c = config
    devices, sampler_devices = jax.devices(), None
    if c.rollout.sampler_devices:
        n = c.rollout.sampler_devices
        if n >= len(devices):
            raise ConfigError(
                f"rollout.sampler_devices={n} leaves no device to train on (of {len(devices)})"
            )
        devices, sampler_devices = devices[:-n], devices[-n:]
    rows = c.rows // c.algorithm.minibatches
    mesh, tokenizer, model_config = setup(c, workdir, rows=rows, devices=devices)
    adaptive = None
    if c.domains.adaptive:
        adaptive = AdaptiveDomains(smoothing=c.domains.smoothing, floor=c.domains.floor)
    prompts = PromptData(
        c.data, tokenizer, max_prompt_len=c.rollout.max_prompt_len, adaptive=adaptive
    )
    if c.rft.steps:
        c = rejection_sampling(c, workdir, prompts, tokenizer, model_config, mesh)
    if c.difficulty.samples:
        filter_by_difficulty(c, workdir, prompts, tokenizer, model_config, mesh)
    eval_prompts = None
    if c.eval_data:
        eval_config = dataclasses.replace(c.data, sources=c.eval_data, shuffle=False)
        eval_prompts = PromptData(eval_config, tokenizer, max_prompt_len=c.rollout.max_prompt_len)
    registry = c.rewards.registry()
    domains = prompts.domains
    registry.check(set(domains) | set(eval_prompts.domains if eval_prompts else ()))
    max_len = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    if max_len > model_config.max_seq_len:
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_new_tokens = {max_len} exceeds the model's "
            f"max_seq_len={model_config.max_seq_len}"
        )
    paths.write_text(paths.join(workdir, "prompts.json"), json.dumps(prompts.stats, indent=2))

    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        lora, base, inputs, input_sh = c.lora, None, (), ()
        extras = {"config": to_json(c), "model_config": to_json(model_config)}
        if lora is None:
            policy = model_trainable(c.model, model_config, mesh, c.train.seed)
        else:  # adapters on a frozen base, which is also the reference (adapters off)
            policy = lora_trainable(lora, model_config, mesh, c.train.seed)
            inputs, input_sh = base_inputs(lora, c.model, model_config, mesh, c.train.seed)
            base = inputs[0]
            extras["lora"] = lora_json(lora, c.model, c.train.seed, ("policy",) if c.ppo else ())
        trainable, critic = policy, None
        if c.ppo:
            value, value_config = value_trainable(
                c.critic.init, c.model, model_config, mesh, c.train.seed
            )
            trainable = Trainable(
                shapes={"policy": policy.shapes, "value": value.shapes},
                shardings={"policy": policy.shardings, "value": value.shardings},
                decay_mask={"policy": policy.decay_mask, "value": value.decay_mask},
                init=lambda: {"policy": policy.init(), "value": value.init()},
            )
            critic = CriticLoss(value_config, coef=c.critic.coef, clip=c.critic.clip)
        optimizer, abstract = optimizer_and_abstract_state(c, trainable, c.updates)
        shardings = state_shardings(optimizer, abstract, trainable.shardings, mesh)
        checkpointer = Checkpointer(workdir, c.checkpoint)
        restored = checkpointer.restore(with_shardings(abstract, shardings))
        kl_coef = c.kl.coef
        if restored is not None:
            start, state, data_state, saved = restored
            prompts.set_state(data_state)
            kl_coef = float(saved.get("rl", {}).get("kl_coef", kl_coef))
            log.info("resumed RL from step %d in %s", start, checkpointer.directory)
        else:
            start = 0
            state = jax.jit(
                functools.partial(create_state, optimizer=optimizer, seed=c.train.seed),
                out_shardings=shardings,
            )(trainable.init())
        ref_params = policy.init() if c.kl.enabled and lora is None else None
        schedule = learning_rate_schedule(c.optimizer, c.updates)

        def step(state, inputs, batch):
            loss = rl_loss(
                model_config,
                c.loss,
                max_new_tokens=c.rollout.max_new_tokens,
                use_reference=c.kl.enabled,
                kl_in_loss=c.kl.mode == "loss",
                domains=domains,
                critic=critic,
                lora=lora,
                base_params=inputs[0] if inputs else None,
            )
            return train_step(
                state,
                batch,
                loss_fn=loss,
                optimizer=optimizer,
                schedule=schedule,
                micro_batches=c.train.micro_batches,
                post_update=trainable.post_update,
            )

        jitted = jax.jit(
            step,
            in_shardings=(shardings, tuple(input_sh), None),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        step_fn = lambda state, batch: jitted(state, inputs, batch)  # noqa: E731
        sampler = SamplerWeights(c, model_config, mesh, base)
        score = Scorer(c, model_config, critic, ref_params, mesh, domains, base)
        with contextlib.ExitStack() as stack:
            pools = [
                stack.enter_context(
                    RewardPool(registry, workers=c.rewards.workers, timeout_s=c.rewards.timeout_s)
                )
                for _ in range(2 if sampler_devices else 1)
            ]
            rollouts = Rollouts(c, tokenizer, model_config, pools[0], domains)
            producer = None
            if sampler_devices:
                # The sampler scores in its own thread: evaluation gets the other pool.
                sampler_mesh = make_mesh(MeshConfig(), sampler_devices)
                producer = RolloutProducer(c, prompts, rollouts, sampler.on(sampler_mesh), start)
                rollouts = Rollouts(c, tokenizer, model_config, pools[1], domains)
                stack.callback(producer.close)
            summary = _loop(
                c,
                workdir,
                start=start,
                state=state,
                kl_coef=kl_coef,
                prompts=prompts,
                eval_prompts=eval_prompts,
                rollouts=rollouts,
                producer=producer,
                sampler=sampler,
                step_fn=step_fn,
                score=score,
                mesh=mesh,
                checkpointer=checkpointer,
                extras=extras,
                on_metrics=on_metrics,
            )
        checkpointer.close()
    summary["model_config"] = model_config
    summary["data"] = prompts.stats
    return summary


def _loop(
    c: RLConfig,
    workdir,
    *,
    start,
    state,
    kl_coef,
    prompts,
    eval_prompts,
    rollouts,
    producer,
    sampler,
    step_fn,
    score,
    mesh,
    checkpointer,
    extras,
    on_metrics,
):
    writer = MetricsWriter(workdir, resume_step=start)
    domains = prompts.domains
    summary: dict = {"start_step": start, "stopped": "completed"}
    saved = start if checkpointer.latest_step() == start else None

    prompt_state = None  # decoupled: the prompt position after the last batch trained on

    def save(step, metrics=None, force=False):
        nonlocal saved
        checkpointer.save(
            step,
            state,
            data_state=prompt_state or prompts.get_state(),
            extra={**extras, "rl": {"kl_coef": kl_coef}},
            metrics=metrics,
            force=force,
        )
        saved = step

    def evaluate(step):
        if eval_prompts is None:
            return None
        metrics = _evaluate(c, eval_prompts, rollouts, sampler(state.params))
        writer.write(step, metrics, split="eval")
        summary["eval"] = metrics
        return metrics

    if start == 0:
        evaluate(0)  # the starting policy's held-out reward: the curve's first point
    if producer is not None:
        producer.start(state.params, start)
    bar = tqdm(total=c.train.steps, initial=start, desc="rl", disable=not c.train.progress)
    step = start
    with _Preemption() as preemption:
        for step in range(start + 1, c.train.steps + 1):
            t0 = time.perf_counter()
            if producer is None:
                weights = sampler(state.params)
                kept, completions, rewards, counts = draw_groups(
                    c, prompts, rollouts, weights, step
                )
                prompt_state = None
            else:
                kept, completions, rewards, counts, prompt_state = producer.get(step)
            t1 = time.perf_counter()
            batch = rollout_batch(
                kept,
                completions,
                rewards,
                groups=c.data.batch_size,
                max_len=rollouts.max_len,
                pad_id=rollouts.tokenizer.pad_id or 0,
            )
            score(state.params, batch, kl_coef)
            t2 = time.perf_counter()
            updates = []
            for _ in range(c.algorithm.epochs):
                for minibatch in split_rows(batch, c.algorithm.minibatches):
                    state, metrics = step_fn(state, shard_batch(minibatch, mesh))
                    updates.append(metrics)
            if producer is not None:
                producer.publish(state.params, step)
            host = {k: float(v) for k, v in jax.device_get(updates[0]).items()}
            last = {k: float(v) for k, v in jax.device_get(updates[-1]).items()}
            t3 = time.perf_counter()
            real = batch["domain_ids"] >= 0
            mask = batch["loss_mask"] > 0
            metrics = {
                # The first update's loss-side metrics: the policy that sampled (on-policy).
                # Token means over no token (every completion masked) are NaN: left out.
                **{k: v for k, v in host.items() if not np.isnan(v) or k == "loss"},
                "loss_last_update": last["loss"],
                "grad_norm": last["grad_norm"],
                "reward": float(batch["rewards"][real].mean()),
                "reward_std": float(batch["rewards"][real].std()),
                "pass_rate": float((batch["rewards"][real] >= c.rewards.pass_threshold).mean()),
                "response_length": float(batch["lengths"][real].mean()),
                "truncated": float(batch["truncated"][real].mean()),
                "logp_gap_max": float(
                    np.abs(batch["old_logps"] - batch["sampler_logps"])[mask].max(initial=0.0)
                ),
                "groups": float(len(kept)),
                **counts,  # with decoupled rollouts: rollout_version and staleness
                **_group_stats(
                    batch["rewards"][real],
                    batch["lengths"][real],
                    domains,
                    batch["domain_ids"][real],
                    c.rewards.pass_threshold,
                ),
                "kl_coef": kl_coef,
                # generate_s and reward_s come with the rollouts (counts); with decoupled
                # rollouts they overlap training, and wait_s is what the trainer waited.
                "wait_s": t1 - t0,
                "prepare_s": t2 - t1,  # the trainer's log-prob / value passes, advantages
                "train_s": t3 - t2,
                "step_s": t3 - t0,
            }
            if c.domains.adaptive:
                # A group carries learning signal when its rewards differ.
                signal: dict[str, list[float]] = {}
                for p, group in zip(kept, rewards, strict=True):
                    signal.setdefault(p["domain"], []).append(float(np.ptp(group) > 0))
                prompts.update_signal({d: float(np.mean(v)) for d, v in signal.items()})
                weights = prompts.domain_weights
                metrics.update({f"domain_weight/{d}": w for d, w in weights.items()})
            if c.kl.target > 0 and "kl" in metrics:
                kl_coef = float(
                    adaptive_kl_update(
                        kl_coef, metrics["kl"], target=c.kl.target, horizon=c.kl.horizon, n_steps=1
                    )
                )
            summary["train"] = metrics
            if step % c.train.log_every == 0 or step == c.train.steps:
                writer.write(step, metrics)
            if on_metrics is not None:
                on_metrics(step, metrics)
            bar.update(1)
            bar.set_postfix(
                {"reward": f"{metrics['reward']:.3f}", "kl": f"{metrics.get('kl', 0.0):.4f}"},
                refresh=False,
            )
            eval_metrics = None
            if c.train.eval_every and step % c.train.eval_every == 0 and step != c.train.steps:
                eval_metrics = evaluate(step)
            if step % checkpointer.every == 0 and step != c.train.steps:
                save(step, eval_metrics)
            if preemption.requested or checkpointer.manager.reached_preemption(step):
                if saved != step:
                    save(step, force=True)
                summary["stopped"] = "preempted"
                break
        if summary["stopped"] == "completed":
            eval_metrics = evaluate(step)
            if saved != step:
                save(step, eval_metrics, force=True)
        checkpointer.wait()
    bar.close()
    writer.close()
    summary["final_step"] = step
    summary["state"] = state
    return summary


def _evaluate(c: RLConfig, eval_prompts: PromptData, rollouts: Rollouts, params) -> dict:
    """Greedy completions of every held-out prompt: mean reward and pass rate (overall and per
    domain); `eval_loss` is minus the reward, so keep-best keeps the best-rewarded checkpoint."""
    rewards, domain_ids = [], []
    prompts = eval_prompts.prompts
    if c.train.eval_batches:
        prompts = prompts[: c.train.eval_batches * eval_prompts.rows]
    for i in range(0, len(prompts), 64):
        chunk = prompts[i : i + 64]
        _, r = rollouts.sample(params, chunk, 0, greedy=True)
        rewards.extend(r[:, 0])
        domain_ids.extend(p["domain_id"] for p in chunk)
    rewards, domain_ids = np.asarray(rewards), np.asarray(domain_ids)
    out = {
        "eval_reward": float(rewards.mean()),
        "eval_pass_rate": float((rewards >= c.rewards.pass_threshold).mean()),
        "eval_prompts": float(len(rewards)),
    }
    for d, name in enumerate(eval_prompts.domains):
        rows = domain_ids == d
        if rows.any():
            out[f"eval_reward/{name}"] = float(rewards[rows].mean())
            out[f"eval_pass_rate/{name}"] = float(
                (rewards[rows] >= c.rewards.pass_threshold).mean()
            )
    out["eval_loss"] = -out["eval_reward"]
    return out
