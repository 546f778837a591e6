"""The RL run (GRPO family; PPO and on-policy distillation are its records in `_ppo.py` and
`_distill.py`): its step, frozen inputs, batch, what it keeps beside the step, the driver that
composes `posttrain.rl`'s rollout source, scorer and policy loss on the shared train loop, and
the `grpo` record.

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
Steps 1-3 are `RolloutSource`, the loop's batch source; step 4 and everything around it
(divergence stop, watchdog, metrics one step late, SIGTERM save, eval, checkpoints) is the
`train` every method runs. Checkpoints hold the train state and the source's state; the
reference is the starting weights, reloaded from `model.*` on resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import paths
from posttrain.aot import Program, bytes_per_device
from posttrain.config import ConfigError
from posttrain.data import prompt_image_spec, prompt_slots
from posttrain.envs import rewards_itself
from posttrain.lora import Policy
from posttrain.methods._method import SEQUENCE, Method, abstract, images, policy_frozen
from posttrain.methods._offline_rl import offline_rl
from posttrain.methods._rft import filter_by_difficulty, rejection_sampling
from posttrain.models import (
    ModelConfig,
    Transformer,
    param_shapes,
    param_shardings,
    with_shardings,
)
from posttrain.parallel import MeshConfig, axis_rules, last_of_each_process, make_mesh
from posttrain.rewards import RewardPool, component_means
from posttrain.rl import (
    AdaptiveDomains,
    CriticLoss,
    PartialProducer,
    PromptData,
    RLConfig,
    RolloutProducer,
    Rollouts,
    RolloutSource,
    SamplerWeights,
    Scorer,
    Teacher,
    check_router_replay,
    critic_config,
    make_episode_env,
    rl_loss,
    route_shape,
    split_teacher_devices,
    teacher_model,
    value_trainable,
)
from posttrain.sampling import planned_decode, planned_prefill
from posttrain.train import (
    BatchPasses,
    StepPlan,
    Trainable,
    base_inputs,
    lora_json,
    policy_trainable,
    setup,
    to_json,
    train,
)

log = logging.getLogger(__name__)


def split_devices(c: RLConfig, devices) -> tuple[list, list | None, list | None]:
    """(training devices, sampler devices or None, teacher devices or None): with
    `rollout.sampler_devices` = N, each process samples on its own last N devices (one
    process: the last N of all); with `distill.teacher_devices` = M, the distillation teacher
    runs on each process's last M devices left (those before the sampler's)."""
    train, sampler = list(devices), None
    if c.rollout.sampler_devices:
        try:
            sampler = last_of_each_process(devices, c.rollout.sampler_devices)
        except ValueError as e:
            raise ConfigError(f"rollout.sampler_devices: {e}") from None
        train = [d for d in devices if d not in sampler]
    train, teacher = split_teacher_devices(c.distill.teacher_devices, train)
    return train, sampler, teacher


def rl_plan(
    c: RLConfig, model_config: ModelConfig, mesh, domains: Sequence[str] = ()
) -> tuple[StepPlan, Trainable, CriticLoss | None]:
    """The RL step (`algorithm.epochs` x `algorithm.minibatches` updates per rollout batch)
    under the policy loss with every option of `c.loss` and `c.kl`; PPO trains
    `{"policy", "value"}` (the critic from `critic.init`). Also returns the policy's own
    `Trainable` (its start is the KL reference) and the critic's loss (None without PPO). The
    loss's named input with LoRA: {"base": the frozen base}."""
    lora = c.lora
    policy = policy_trainable(c, model_config, mesh)
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

    def loss(frozen: dict):
        return rl_loss(
            model_config,
            c.loss,
            max_new_tokens=c.rollout.max_new_tokens,
            use_reference=c.kl.enabled,
            kl_in_loss=c.kl.mode == "loss",
            domains=domains,
            critic=critic,
            policy=Policy(lora, frozen.get("base"), key="policy" if c.ppo else None),
            fused_old_logps=c.fused_old_logps,
        )

    passes = BatchPasses(c.algorithm.epochs, c.algorithm.minibatches)
    return StepPlan(trainable, loss, passes), policy, critic


def run_rl(config: RLConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) a GRPO-family or PPO run in `workdir`; returns a summary.

    Returns:
      {"final_step", "stopped", "train" (last metrics), "eval" (last eval), "state",
      "model_config", "data" (prompt stats)}.
    """
    c = config
    devices, sampler_devices, teacher_devices = split_devices(c, jax.devices())
    rows = c.rows // c.algorithm.minibatches
    mesh, tokenizer, model_config = setup(c, workdir, rows=rows, devices=devices)
    check_router_replay(c, model_config)
    images = prompt_image_spec(
        model_config.vision, tokenizer, c.rollout.max_prompt_len, c.data.max_images
    )
    if images is not None and (c.env.name or c.rollout.partial):
        raise ConfigError(
            "a vision-language model's rollouts are single-turn and whole for now (multi-turn "
            "episodes and partial rollouts take no images yet); unset env.name and "
            "rollout.partial"
        )
    adaptive = None
    if c.domains.adaptive:
        adaptive = AdaptiveDomains(smoothing=c.domains.smoothing, floor=c.domains.floor)
    # Every process draws the whole prompt stream (the same on all): see rl/_shares.py.
    prompts = PromptData(
        c.data,
        tokenizer,
        max_prompt_len=c.rollout.max_prompt_len,
        adaptive=adaptive,
        grouped=c.domains.grouped,
        process_index=0,
        process_count=1,
        images=images,
        fit_documents=c.rollout.fit_documents,
    )
    for field in ("kl.domain_scale", "domains.lr_scale"):
        section, name = field.split(".")
        if unknown := set(getattr(getattr(c, section), name)) - set(prompts.domains):
            raise ConfigError(
                f"{field} names domains the prompts do not have: {sorted(unknown)} (domains: "
                f"{list(prompts.domains)})"
            )
    if c.rft.steps:
        c = rejection_sampling(c, workdir, prompts, tokenizer, model_config, mesh)
    if c.offline.steps:  # offline RL on logged trajectories, in <workdir>/offline
        c, stage = offline_rl(c, workdir)
        if stage["stopped"] == "preempted":  # saved mid-stage: a rerun resumes it
            return stage
    if c.difficulty.samples:
        filter_by_difficulty(c, workdir, prompts, tokenizer, model_config, mesh)
    eval_prompts = None
    if c.eval_data:
        eval_config = dataclasses.replace(
            c.data, sources=c.eval_data, shuffle=False, curriculum=()
        )  # (the training curriculum names the training sources)
        eval_prompts = PromptData(
            eval_config,
            tokenizer,
            max_prompt_len=c.rollout.max_prompt_len,
            process_index=0,
            process_count=1,
            images=images,
            fit_documents=c.rollout.fit_documents,
        )
    registry = c.rewards.registry()
    domains = prompts.domains
    scored = set(domains) | set(eval_prompts.domains if eval_prompts else ())
    if not (c.env.name and rewards_itself(c.env.name)):  # (else its episodes carry rewards)
        registry.check(scored)
    if c.env.name:  # its options (and a record it refuses): one line now, not at step 1
        try:
            make_episode_env(c.env, prompts.prompts[0]["record"], c.train.seed).close()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"env.name={c.env.name!r} env.options={c.env.options}: {e}") from None
    max_len = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    if max_len > model_config.max_seq_len:
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_new_tokens = {max_len} exceeds the model's "
            f"max_seq_len={model_config.max_seq_len}"
        )
    if c.distill.enabled:
        teacher_model(c.distill.teacher, model_config)  # (a missing or mismatched teacher: now)
    paths.write_text(paths.join(workdir, "prompts.json"), json.dumps(prompts.stats, indent=2))

    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        lora, base, inputs, input_sh = c.lora, None, {}, {}
        extras = {"config": to_json(c), "model_config": to_json(model_config)}
        plan, policy, critic = rl_plan(c, model_config, mesh, domains)
        if lora is not None:  # adapters on a frozen base, which is also the reference
            inputs, input_sh = base_inputs(lora, c.model, model_config, mesh, c.train.seed)
            base = inputs["base"]
            extras["lora"] = lora_json(lora, c.model, c.train.seed, ("policy",) if c.ppo else ())
        ref_params = policy.init() if c.kl.enabled and lora is None else None

        sampler = SamplerWeights(c, model_config, mesh, base)
        teacher = None
        if c.distill.enabled:
            own = teacher_devices is not None
            teacher_mesh = make_mesh(MeshConfig(), teacher_devices) if own else mesh
            teacher = Teacher(c.distill.teacher, model_config, teacher_mesh, own_mesh=own)
        score = Scorer(c, model_config, critic, ref_params, mesh, domains, base, teacher)
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
                mine = [d for d in sampler_devices if d.process_index == jax.process_index()]
                sampler_side = sampler.on(make_mesh(MeshConfig(), mine))
                sampler_rollouts = Rollouts(
                    c, tokenizer, model_config, pools[0], domains, channel="sampler"
                )
                rollouts = Rollouts(c, tokenizer, model_config, pools[1], domains)

                def producer(start: int) -> RolloutProducer:
                    kind = PartialProducer if c.rollout.partial else RolloutProducer
                    return kind(c, prompts, sampler_rollouts, sampler_side, start)

            source = RolloutSource(c, prompts, rollouts, sampler, score, producer)
            stack.callback(source.close)
            stack.callback(rollouts.close)
            if sampler_devices:
                stack.callback(sampler_rollouts.close)
            evaluate = None
            if eval_prompts is not None:

                def evaluate(state) -> dict:
                    return _evaluate(c, eval_prompts, rollouts, sampler(state.params))

            summary = train(
                c,
                workdir,
                mesh=mesh,
                plan=plan,
                data=source,
                loss_inputs=inputs,
                loss_input_shardings=input_sh,
                evaluate=evaluate,
                extras=extras,
                on_metrics=on_metrics,
                eval_first=True,
            )
    summary.update(model_config=model_config, domains=domains)
    return summary


def _evaluate(c: RLConfig, eval_prompts: PromptData, rollouts: Rollouts, params) -> dict:
    """Greedy completions of every held-out prompt: mean reward and pass rate (overall and per
    domain); `eval_loss` is minus the reward, so keep-best keeps the best-rewarded checkpoint."""
    rewards, domain_ids, tallies = [], [], {}
    prompts = eval_prompts.prompts
    if c.train.eval_batches:
        prompts = prompts[: c.train.eval_batches * eval_prompts.rows]
    for i in range(0, len(prompts), 64):
        chunk = prompts[i : i + 64]
        _, r = rollouts.sample(params, chunk, 0, greedy=True, timings=tallies,
                               label=f"eval prompts {i}-{i + len(chunk)}")  # fmt: skip
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
    parts = component_means(tallies).items()
    out.update({f"eval_{k}": v for k, v in parts if k.startswith(("reward_parts/", "response"))})
    out["eval_loss"] = -out["eval_reward"]
    return out


def rl_batch(c: RLConfig, mesh):
    """One RL step's rollout batch (what `RolloutSource` yields) as abstract arrays: every row
    of the step (its minibatches and epochs are updates inside the step)."""
    rows = c.rows
    length = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    floats = ("loss_mask", "sampler_logps", "old_logps")
    floats += ("ref_logps",) * c.kl.enabled + ("returns", "old_values") * c.ppo
    per_row = {"rewards": jnp.float32, "truncated": jnp.float32, "kl_coefs": jnp.float32,
               "lengths": jnp.float32, "domain_ids": jnp.int32}  # fmt: skip
    shapes = {k: ((rows, length), jnp.int32) for k in SEQUENCE}
    shapes |= {k: ((rows, length), jnp.float32) for k in floats}
    shapes |= {k: ((rows,), t) for k, t in per_row.items()}
    per_token = c.ppo or c.distill.enabled  # (GAE, or distillation's per-token advantages)
    shapes["advantages"] = ((rows, length) if per_token else (rows,), jnp.float32)
    if vision := c.model.model_config().vision:  # a VLM's prompt images (`prompt_image_spec`)
        slots = prompt_slots(vision, c.rollout.max_prompt_len, c.data.max_images)
        shapes |= images(c, rows, length, slots)
    if routes := route_shape(c.loss.router_replay, c.model.model_config()):  # router replay
        shapes["routed_experts"] = ((rows, length, *routes), jnp.int16)
    return abstract(shapes, mesh), rows * length, length


def rl_resident(c: RLConfig, model_config: ModelConfig, mesh) -> dict:
    """GRPO/PPO's frozen reference (the LoRA base with adapters off costs nothing more) and
    the merged weights a LoRA policy samples with (co-located sampler). The sampler's KV pool
    is in its decode call's arguments (`rl_programs`)."""
    out = {}
    full = param_shardings(model_config, mesh)
    if c.kl.enabled and c.lora is None:
        out["reference"] = bytes_per_device(param_shapes(model_config), full)
    if c.lora is not None and not c.rollout.sampler_devices:
        out["sampler weights (merged)"] = bytes_per_device(param_shapes(model_config), full)
    return out


def rl_programs(c: RLConfig, model_config: ModelConfig, mesh) -> dict:
    """The co-located sampler's calls as a run on the training mesh makes them (the engine's
    rows and KV pool laid out as the engine lays them out, a step's samples decoding at once
    by default): the prefill of a first admission round (every row's prompt, each group's
    once) and a decode call. On several hosts that is `rollout.sampler_mesh="global"`, the
    only layout for a model no host holds whole. A decoupled sampler runs on devices of its
    own (not compiled here)."""
    if c.rollout.sampler_devices:
        return {}
    r = c.rollout
    slots = c.data.batch_size * r.num_generations * (2 if r.partial else 1)
    config = dataclasses.replace(r.engine.sized(slots), record_routes=c.loss.router_replay != "off")
    weights = with_shardings(param_shapes(model_config), param_shardings(model_config, mesh))
    length, model = r.max_prompt_len + r.max_new_tokens, Transformer(weights, model_config)
    blocks = config.num_blocks or 1 + config.slots * -(-length // config.block_size)
    pool = f"a KV pool of {blocks} blocks of {config.block_size} tokens, on the training mesh"
    shared = bytes_per_device(weights, jax.tree.map(lambda x: x.sharding, weights))
    n = min(r.num_generations, config.slots)
    prefill = planned_prefill(model, config, length, r.max_prompt_len, n, mesh)
    decode = planned_decode(model, config, length, mesh)
    return {
        "rollout prefill": Program(*prefill, shared=shared, label=(
            f"{config.slots // n} prompts of {r.max_prompt_len} tokens, each prefilled once "
            f"for its {n} samples, {pool}")),
        "rollout decode": Program(*decode, shared=shared, label=(
            f"{config.slots} rows of {length} tokens, {config.chunk} steps a call, {pool}")),
    }  # fmt: skip


def rl_method(name: str, check) -> Method:
    """An RL record: the one driver, plan, batch and memory, with `check` refusing the configs
    this method does not run (before its run starts)."""

    def run(config: RLConfig, workdir: str, **kwargs) -> dict:
        check(config)
        return run_rl(config, workdir, **kwargs)

    return Method(
        name=name,
        config=RLConfig,
        run=run,
        plan=lambda c, m, mesh, domains: rl_plan(c, m, mesh, domains)[0],
        frozen=policy_frozen,
        batch=rl_batch,
        rows=lambda c: c.rows // c.algorithm.minibatches,
        # (every epoch trains on every row; PPO's critic too: trunk and value head, no logits)
        also_trained=lambda c, m: ((critic_config(c.critic.init, m), False),) if c.ppo else (),
        epochs=lambda c: c.algorithm.epochs,
        devices=lambda c, devices: split_devices(c, devices)[0],
        resident=rl_resident,
        programs=rl_programs,
        check=check,
    )


def _check_grpo(c: RLConfig) -> None:
    if c.ppo:
        raise ConfigError(
            "method=grpo takes group advantages, but algorithm.advantage=gae (a critic) is PPO: "
            "set method=ppo (configs/ppo.py) or algorithm.advantage=grpo"
        )


GRPO = rl_method("grpo", _check_grpo)
