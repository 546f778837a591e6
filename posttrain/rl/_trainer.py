"""The RL loop (GRPO family): prompts -> rollouts -> rewards -> advantages -> policy updates.

One RL step:
  1. draws `data.batch_size` prompts and samples `rollout.num_generations` completions of each
     with the current weights (co-located: the sampler reads the train state's params);
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
import itertools
import json
import logging
import os
import queue
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain.config import ConfigError
from posttrain.data import DataConfig, SourceConfig
from posttrain.losses import (
    ADVANTAGE_MODES,
    adaptive_kl_update,
    gae,
    group_advantages,
    kl_estimate,
    whiten,
)
from posttrain.models import Transformer, param_shardings
from posttrain.parallel import MeshConfig, axis_rules, make_mesh, shard_batch
from posttrain.rewards import (
    RewardPool,
    RewardRegistry,
    default_registry,
    overlong_penalty,
    pass_rate,
)
from posttrain.rl._critic import token_values, value_trainable
from posttrain.rl._loss import CriticLoss, PolicyLossConfig, rl_loss, sequence_log_probs
from posttrain.rl._prompts import AdaptiveDomains, PromptData
from posttrain.rl._rollout import rollout_batch, split_rows
from posttrain.sampling import generate
from posttrain.train._checkpoint import CheckpointConfig, Checkpointer
from posttrain.train._loop import LoopConfig, _Preemption
from posttrain.train._metrics import MetricsWriter
from posttrain.train._optimizer import OptimizerConfig, learning_rate_schedule
from posttrain.train._run import (
    ModelSpec,
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


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_generations: int = 8  # completions per prompt (the group size G)
    max_prompt_len: int = 512  # longer prompts are left out (counted)
    max_new_tokens: int = 512  # completion budget; cut completions count as truncated
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups, draw prompts to refill
    max_refills: int = 4  # extra prompt batches one step may draw to refill
    overlong_buffer: int = 0  # DAPO soft over-length penalty ramp in tokens (0: off)
    # Decoupled rollouts: > 0 puts the sampler on the last N devices (the rest train), with
    # its own copy of the weights, sent after every step; 0 samples on the training devices.
    sampler_devices: int = 0
    max_staleness: int = 0  # decoupled: rollouts may come from weights this many steps old

    def __post_init__(self):
        if self.num_generations < 1 or self.max_new_tokens < 1 or self.max_prompt_len < 1:
            raise ConfigError("rollout: num_generations, max_new_tokens, max_prompt_len >= 1")
        if self.overlong_buffer < 0 or self.overlong_buffer > self.max_new_tokens:
            raise ConfigError("rollout.overlong_buffer must be in [0, max_new_tokens]")
        if self.sampler_devices < 0 or self.max_staleness < 0:
            raise ConfigError("rollout.sampler_devices and rollout.max_staleness must be >= 0")
        if self.max_staleness and not self.sampler_devices:
            raise ConfigError("rollout.max_staleness needs decoupled rollouts (sampler_devices)")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    # grpo | drgrpo (no std scaling) | rloo (leave-one-out) | none | gae (PPO, with a critic)
    advantage: str = "grpo"
    unbiased_std: bool = True  # GRPO's group std (torch.std default, as TRL)
    std_eps: float = 1e-4  # added to the group std
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    whiten_advantages: bool = True  # GAE: whiten advantages over the batch's tokens
    epochs: int = 1  # passes over each rollout batch (PPO epochs)
    minibatches: int = 1  # optimizer updates per pass

    def __post_init__(self):
        if self.advantage not in (*ADVANTAGE_MODES, "gae"):
            raise ConfigError(f"algorithm.advantage: use one of {(*ADVANTAGE_MODES, 'gae')}")
        if self.epochs < 1 or self.minibatches < 1:
            raise ConfigError("algorithm.epochs and algorithm.minibatches must be >= 1")


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """PPO's value model (used when algorithm.advantage is "gae")."""

    init: str = "policy"  # policy (its starting trunk, zero head) | rm:<reward model run>[#head]
    coef: float = 0.5  # value-loss weight
    clip: float = 0.2  # value clip around the rollout-time values (0: off)


@dataclasses.dataclass(frozen=True)
class KLConfig:
    mode: str = "loss"  # loss: a per-token loss term | reward: a per-token reward penalty (PPO)
    coef: float = 0.0  # KL penalty weight (0 with no target: no reference model)
    target: float = 0.0  # > 0: adapt coef toward this mean per-token KL (Ziegler et al.)
    horizon: int = 1000  # the adaptive controller's horizon, in RL steps
    domain_scale: dict = dataclasses.field(default_factory=dict)  # {domain: coef multiplier}

    def __post_init__(self):
        if self.mode not in ("loss", "reward"):
            raise ConfigError(f"kl.mode={self.mode!r}: use loss or reward")

    @property
    def enabled(self) -> bool:
        return self.coef > 0 or self.target > 0


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    # {domain: [reward reference, ...]} ("module:function" or "rm:<path>[#head]"), each
    # weight 1; empty: the built-in registry (math, code, format, tool_call, arithmetic).
    domains: dict = dataclasses.field(default_factory=dict)
    workers: int = 2  # verifier processes
    timeout_s: float = 10.0  # per completion
    pass_threshold: float = 1.0  # a completion "passes" with reward >= this (pass-rate metric)

    def registry(self) -> RewardRegistry:
        if not self.domains:
            return default_registry()
        registry = RewardRegistry()
        for domain, refs in self.domains.items():
            for ref in [refs] if isinstance(refs, str) else refs:
                registry.register(domain, ref)
        return registry


@dataclasses.dataclass(frozen=True)
class DomainsConfig:
    """How prompts are drawn across domains."""

    adaptive: bool = False  # False: the sources' static weights; True: follow learning signal
    smoothing: float = 0.9  # adaptive: exponential average of each domain's signal
    floor: float = 0.1  # adaptive: every domain keeps at least this share of its base weight

    def __post_init__(self):
        if not (0 <= self.smoothing < 1 and self.floor > 0):
            raise ConfigError("domains.smoothing must be in [0, 1) and domains.floor > 0")


@dataclasses.dataclass(frozen=True)
class DifficultyConfig:
    """Difficulty filtering before RL (0 samples: off): the starting policy answers each prompt
    `samples` times; prompts whose pass rate is not strictly between the bounds are dropped."""

    samples: int = 0  # completions per prompt to estimate pass rates (0: no filtering)
    prompts: int = 0  # only the first N prompts are estimated (0: all); the rest are kept
    min_pass_rate: float = 0.0  # at or below: too hard (no signal)
    max_pass_rate: float = 1.0  # at or above: too easy (no signal)


@dataclasses.dataclass(frozen=True)
class RFTConfig:
    """Rejection-sampling fine-tuning before online RL (0 steps: off): sample `samples`
    completions of `prompts` training prompts, keep those whose reward passes, SFT on them."""

    steps: int = 0  # SFT steps on the kept completions (0: no RFT stage)
    prompts: int = 1024  # training prompts sampled
    samples: int = 8  # completions per prompt
    batch_size: int = 32  # SFT rows per step
    learning_rate: float = 1e-5


@dataclasses.dataclass(frozen=True)
class RLConfig:
    model: ModelSpec = ModelSpec()  # the policy's start (and the frozen reference)
    tokenizer: str = ""  # tokenizer directory; default: model.hf_path
    data: DataConfig = None  # prompt sources; batch_size = prompts per RL step
    eval_data: tuple[SourceConfig, ...] = ()  # held-out prompts: greedy reward and pass rate
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    critic: CriticConfig = CriticConfig()
    loss: PolicyLossConfig = PolicyLossConfig()
    kl: KLConfig = KLConfig()
    rewards: RewardsConfig = RewardsConfig()
    rft: RFTConfig = RFTConfig()
    domains: DomainsConfig = DomainsConfig()
    difficulty: DifficultyConfig = DifficultyConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: LoopConfig = LoopConfig()  # steps = RL steps
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if self.data is None:
            raise ConfigError("data: set data.sources to at least one prompt file")
        rows = self.data.batch_size * self.rollout.num_generations
        if rows % self.algorithm.minibatches:
            raise ConfigError(
                f"{rows} rollouts per step (data.batch_size x rollout.num_generations) do not "
                f"split into algorithm.minibatches={self.algorithm.minibatches}"
            )

    @property
    def ppo(self) -> bool:
        return self.algorithm.advantage == "gae"

    @property
    def rows(self) -> int:
        return self.data.batch_size * self.rollout.num_generations

    @property
    def updates(self) -> int:
        return self.train.steps * self.algorithm.epochs * self.algorithm.minibatches


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


class _Rollouts:
    """Sampling and scoring of prompt batches with the current weights."""

    def __init__(self, config: RLConfig, tokenizer, model_config, pool, domains):
        self.config, self.tokenizer, self.model_config = config, tokenizer, model_config
        self.pool, self.domains = pool, domains
        self.max_len = config.rollout.max_prompt_len + config.rollout.max_new_tokens

    def sample(self, params, prompts, seed: int, *, greedy: bool = False, timings=None):
        """(completions per prompt, rewards `[prompts, n]`); adds the seconds spent to
        `timings["generate_s"]` and `timings["reward_s"]` when given."""
        r = self.config.rollout
        start = time.perf_counter()
        model = Transformer(params, self.model_config)
        completions = generate(
            model,
            self.tokenizer,
            [p["prompt_ids"] for p in prompts],
            max_new_tokens=r.max_new_tokens,
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            n=1 if greedy else r.num_generations,
            seed=seed,
        )
        generated = time.perf_counter()
        records = [p["record"] for p in prompts for _ in completions[0]]
        texts = [c.text for group in completions for c in group]
        domains = [p["domain"] for p in prompts for _ in completions[0]]
        results = self.pool.score(records, texts, domains)
        rewards = np.asarray([res.score for res in results], np.float32)
        rewards = rewards.reshape(len(prompts), len(completions[0]))
        if r.overlong_buffer and not greedy:
            lengths = np.asarray([[len(c.token_ids) for c in g] for g in completions])
            rewards = rewards + overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer)
        if timings is not None:
            timings["generate_s"] = timings.get("generate_s", 0.0) + generated - start
            timings["reward_s"] = timings.get("reward_s", 0.0) + time.perf_counter() - generated
        return completions, rewards


def run_rl(config: RLConfig, workdir: str, *, on_metrics=None) -> dict:
    """Trains (or resumes) a GRPO-family run in `workdir`; returns a summary.

    Returns:
      {"final_step", "stopped", "train" (last metrics), "eval" (last eval), "state",
      "model_config", "data" (prompt stats)}.
    """
    if jax.process_count() > 1:
        raise ConfigError("RL runs on one host for now; multi-host RL is issue #9's")
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
        c = _rejection_sampling(c, workdir, prompts, tokenizer, model_config, mesh)
    if c.difficulty.samples:
        _filter_by_difficulty(c, workdir, prompts, tokenizer, model_config, mesh)
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
    with open(os.path.join(workdir, "prompts.json"), "w") as f:
        json.dump(prompts.stats, f, indent=2)

    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        policy = model_trainable(c.model, model_config, mesh, c.train.seed)
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
            start, state, data_state, extras = restored
            prompts.set_state(data_state)
            kl_coef = float(extras.get("rl", {}).get("kl_coef", kl_coef))
            log.info("resumed RL from step %d in %s", start, checkpointer.directory)
        else:
            start = 0
            state = jax.jit(
                functools.partial(create_state, optimizer=optimizer, seed=c.train.seed),
                out_shardings=shardings,
            )(trainable.init())
        ref_params = policy.init() if c.kl.enabled else None
        schedule = learning_rate_schedule(c.optimizer, c.updates)
        loss = rl_loss(
            model_config,
            c.loss,
            max_new_tokens=c.rollout.max_new_tokens,
            use_reference=c.kl.enabled,
            kl_in_loss=c.kl.mode == "loss",
            domains=domains,
            critic=critic,
        )
        step_fn = jax.jit(
            functools.partial(
                train_step,
                loss_fn=loss,
                optimizer=optimizer,
                schedule=schedule,
                micro_batches=c.train.micro_batches,
            ),
            in_shardings=(shardings, None),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        score = _Scorer(c, model_config, critic, ref_params, mesh, domains)
        with contextlib.ExitStack() as stack:
            pools = [
                stack.enter_context(
                    RewardPool(registry, workers=c.rewards.workers, timeout_s=c.rewards.timeout_s)
                )
                for _ in range(2 if sampler_devices else 1)
            ]
            rollouts = _Rollouts(c, tokenizer, model_config, pools[0], domains)
            producer = None
            if sampler_devices:
                # The sampler scores in its own thread: evaluation gets the other pool.
                sampler_mesh = make_mesh(MeshConfig(), sampler_devices)
                shardings = param_shardings(model_config, sampler_mesh)
                producer = _Producer(c, prompts, rollouts, shardings, start)
                rollouts = _Rollouts(c, tokenizer, model_config, pools[1], domains)
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
                step_fn=step_fn,
                score=score,
                mesh=mesh,
                checkpointer=checkpointer,
                extras={"config": to_json(c), "model_config": to_json(model_config)},
                on_metrics=on_metrics,
            )
        checkpointer.close()
    summary["model_config"] = model_config
    summary["data"] = prompts.stats
    return summary


def _filter_by_difficulty(c: RLConfig, workdir, prompts, tokenizer, model_config, mesh) -> None:
    """Drops the prompts the starting policy always or never solves (pass rate outside
    (min_pass_rate, max_pass_rate) over `difficulty.samples` samples); the estimates are
    stored in `<workdir>/difficulty.json` and reused on resume."""
    d = c.difficulty
    path = os.path.join(workdir, "difficulty.json")
    count = len(prompts.prompts) if not d.prompts else min(d.prompts, len(prompts.prompts))
    key = {"samples": d.samples, "prompts": count, "model": to_json(c.model)}
    saved = None
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved.get("key") != json.loads(json.dumps(key)):
            saved = None
    if saved is None:
        with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
            params = model_trainable(c.model, model_config, mesh, c.train.seed).init()
        sampling = dataclasses.replace(
            c, rollout=dataclasses.replace(c.rollout, num_generations=d.samples)
        )
        scores = {}
        with RewardPool(
            c.rewards.registry(), workers=c.rewards.workers, timeout_s=c.rewards.timeout_s
        ) as pool:
            rollouts = _Rollouts(sampling, tokenizer, model_config, pool, prompts.domains)
            bar = tqdm(total=count, desc="difficulty", disable=not c.train.progress)
            for i in range(0, count, 64):
                batch = prompts.prompts[i : min(i + 64, count)]
                _, rewards = rollouts.sample(params, batch, seed=c.train.seed + 104729 + i)
                scores.update({i + j: r.tolist() for j, r in enumerate(rewards)})
                bar.update(len(batch))
            bar.close()
        rates = pass_rate(scores, threshold=c.rewards.pass_threshold)
        saved = {"key": key, "pass_rates": {str(k): v for k, v in rates.items()}}
        with open(path, "w") as f:
            json.dump(saved, f)
    rates = {int(k): v for k, v in saved["pass_rates"].items()}
    kept = [i for i in range(len(prompts.prompts)) if i not in rates]
    kept += [i for i, r in rates.items() if d.min_pass_rate < r < d.max_pass_rate]
    prompts.stats["difficulty"] = {
        "estimated": len(rates),
        "too_hard": sum(r <= d.min_pass_rate for r in rates.values()),
        "too_easy": sum(r >= d.max_pass_rate for r in rates.values()),
        "kept": len(kept),
    }
    log.info("difficulty filtering: %s", prompts.stats["difficulty"])
    prompts.keep(kept)


def _rejection_sampling(c: RLConfig, workdir, prompts, tokenizer, model_config, mesh) -> RLConfig:
    """The offline stage: RFT data from the starting policy, an SFT run on it in
    `<workdir>/rft`, and the RL config continuing from that run's checkpoint. A finished stage
    (its checkpoint exists) is reused, so a resumed run does not repeat it."""
    from posttrain.train._sft import SFTConfig, run_sft

    rft_dir = os.path.join(workdir, "rft")
    data_path = os.path.join(rft_dir, "data.jsonl")
    done = os.path.isdir(os.path.join(rft_dir, "checkpoints")) and os.listdir(
        os.path.join(rft_dir, "checkpoints")
    )
    if not done:
        os.makedirs(rft_dir, exist_ok=True)
        with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
            params = model_trainable(c.model, model_config, mesh, c.train.seed).init()
        sampling = dataclasses.replace(
            c, rollout=dataclasses.replace(c.rollout, num_generations=c.rft.samples)
        )
        chosen = prompts.prompts[: c.rft.prompts]
        registry = c.rewards.registry()
        kept, scored = [], 0
        with RewardPool(registry, workers=c.rewards.workers, timeout_s=c.rewards.timeout_s) as pool:
            rollouts = _Rollouts(sampling, tokenizer, model_config, pool, prompts.domains)
            for i in tqdm(
                range(0, len(chosen), 64), desc="rft samples", disable=not c.train.progress
            ):
                batch = chosen[i : i + 64]
                completions, rewards = rollouts.sample(params, batch, seed=c.train.seed + i)
                for p, group, r in zip(batch, completions, rewards, strict=True):
                    texts = {
                        g.text
                        for g, ok in zip(group, r >= c.rewards.pass_threshold, strict=True)
                        if ok and g.finish_reason == "stop"
                    }
                    kept.extend(
                        {"prompt": p["record"]["prompt"], "completion": t} for t in sorted(texts)
                    )
                    scored += len(group)
        if not kept:
            raise ValueError(
                f"rejection sampling kept no completion of {scored}: none both ended (EOS within "
                f"rollout.max_new_tokens) and reached rewards.pass_threshold="
                f"{c.rewards.pass_threshold}; lower the threshold, raise rft.samples or "
                "max_new_tokens, or set rft.steps=0"
            )
        with open(data_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        log.info("rejection sampling kept %d of %d completions", len(kept), scored)
        sft = SFTConfig(
            model=c.model,
            tokenizer=c.tokenizer,
            data=DataConfig(
                sources=(SourceConfig(data_path, format="prompt_completion"),),
                max_len=c.rollout.max_prompt_len + c.rollout.max_new_tokens,
                batch_size=c.rft.batch_size,
                seed=c.data.seed,
            ),
            optimizer=dataclasses.replace(
                c.optimizer, learning_rate=c.rft.learning_rate, warmup_steps=0
            ),
            train=dataclasses.replace(c.train, steps=c.rft.steps, eval_every=0),
            checkpoint=dataclasses.replace(c.checkpoint, every=c.rft.steps, keep_best=0),
            mesh=c.mesh,
        )
        run_sft(sft, rft_dir)
    return dataclasses.replace(c, model=ModelSpec(checkpoint=rft_dir, **c.model.overrides()))


class _Producer:
    """Decoupled rollouts: a thread samples and scores batches on the sampler's devices with the
    newest weights it was sent, at most `rollout.max_staleness` steps ahead of the trainer.

    Batch i (for RL step i) needs weights of version >= i - 1 - max_staleness (version v: the
    weights after v RL steps); with 0 it waits for the step before, which is on-policy.
    """

    def __init__(self, c: RLConfig, prompts, rollouts: _Rollouts, shardings, start: int):
        self.c, self.prompts, self.rollouts, self.shardings = c, prompts, rollouts, shardings
        self.ready: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.weights, self.version, self.stopped = None, -1, False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(start + 1,), daemon=True)
        self.started = False

    def publish(self, params, version: int) -> None:
        """Sends the trainer's policy weights (after `version` RL steps) to the sampler's
        devices, resharding them onto its mesh."""
        weights = jax.device_put(params, self.shardings)
        with self.cond:
            self.weights, self.version = weights, version
            self.cond.notify_all()

    def get(self, step: int):
        """The rollouts for `step`: (prompts, completions, rewards, counts, prompt state)."""
        item = self.ready.get()
        if item is None:
            raise RuntimeError("the rollout thread failed") from self.error
        i, version, kept, completions, rewards, counts, state = item
        staleness = step - 1 - version
        if i != step or staleness > self.c.rollout.max_staleness:
            raise RuntimeError(f"rollout {i} (weights v{version}) for step {step}: out of bounds")
        counts = {**counts, "rollout_version": float(version), "staleness": float(staleness)}
        return kept, completions, rewards, counts, state

    def _run(self, first: int) -> None:
        try:
            for i in itertools.count(first):
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.stopped or self.version >= i - 1 - self.c.rollout.max_staleness  # noqa: B023
                    )
                    if self.stopped:
                        return
                    weights, version = self.weights, self.version
                kept, completions, rewards, counts = _draw(
                    self.c, self.prompts, self.rollouts, weights, i
                )
                state = self.prompts.get_state()
                self.ready.put((i, version, kept, completions, rewards, counts, state))
        except BaseException as e:  # reported to the trainer by get()
            self.error = e
            self.ready.put(None)

    def start(self, params, version: int) -> None:
        self.publish(params, version)
        if not self.started:
            self.started = True
            self.thread.start()

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        if self.started:
            self.thread.join(timeout=300)


def _policy(c: RLConfig, params):
    """The policy's params inside the trained params (PPO also trains a critic)."""
    return params["policy"] if c.ppo else params


class _Scorer:
    """The trainer's passes over a rollout batch before its updates: the old policy's and the
    reference's log-probs of the sampled tokens, the critic's values, the KL penalty when it
    is a reward, and the advantages (group-relative, or GAE with the critic)."""

    def __init__(self, c: RLConfig, model_config, critic, ref_params, mesh, domains):
        self.c, self.model_config, self.critic = c, model_config, critic
        self.ref_params, self.mesh = ref_params, mesh
        self.scale = np.asarray([c.kl.domain_scale.get(d, 1.0) for d in domains] + [0.0])
        self.logps = jax.jit(sequence_log_probs, static_argnums=1)
        if critic is not None:
            self.values = jax.jit(token_values, static_argnums=1)
            a = c.algorithm
            self.gae = jax.jit(functools.partial(gae, gamma=a.gamma, lam=a.lam))

    def __call__(self, params, batch: dict, kl_coef: float) -> None:
        """Adds `old_logps`, `ref_logps`, `kl_coefs`, `advantages` (and with a critic
        `old_values`, `returns`) to the host batch."""
        c = self.c
        device_batch = shard_batch(batch, self.mesh)
        policy = _policy(c, params)
        batch["old_logps"] = np.asarray(self.logps(policy, self.model_config, device_batch))
        batch["kl_coefs"] = (kl_coef * self.scale[batch["domain_ids"]]).astype(np.float32)
        mask = batch["loss_mask"]
        penalty = np.zeros_like(mask)
        if self.ref_params is not None:
            ref = self.logps(self.ref_params, self.model_config, device_batch)
            batch["ref_logps"] = np.asarray(ref)
            if c.kl.mode == "reward":
                kl = kl_estimate(batch["old_logps"], ref, c.loss.kl_estimator, mask)
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
            return
        values = np.asarray(self.values(params["value"], self.critic.model_config, device_batch))
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


def _draw(c: RLConfig, prompts, rollouts: _Rollouts, params, step: int):
    """This step's prompt groups with their completions and rewards (refilled when dynamic
    sampling drops groups with no learning signal) and the counts behind it."""
    groups = c.data.batch_size
    kept, completions, rewards = [], [], []
    drawn = dropped = 0
    timings: dict[str, float] = {}
    for attempt in range(1 + (c.rollout.max_refills if c.rollout.dynamic_sampling else 0)):
        batch = next(prompts)
        drawn += len(batch)
        seed = int(np.random.SeedSequence([c.train.seed, step, attempt]).generate_state(1)[0])
        comps, rews = rollouts.sample(params, batch, seed, timings=timings)
        for p, g, r in zip(batch, comps, rews, strict=True):
            if c.rollout.dynamic_sampling and np.all(r == r[0]):
                dropped += 1
                continue
            if len(kept) < groups:
                kept.append(p)
                completions.append(g)
                rewards.append(r)
        if len(kept) >= groups:
            break
    all_rewards = np.asarray(rewards, np.float32).reshape(len(kept), -1)
    counts = {"prompts_drawn": drawn, "groups_dropped": dropped, **timings}
    return kept, completions, all_rewards, counts


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
        metrics = _evaluate(c, eval_prompts, rollouts, _policy(c, state.params))
        writer.write(step, metrics, split="eval")
        summary["eval"] = metrics
        return metrics

    if start == 0:
        evaluate(0)  # the starting policy's held-out reward: the curve's first point
    if producer is not None:
        producer.start(_policy(c, state.params), start)
    bar = tqdm(total=c.train.steps, initial=start, desc="rl", disable=not c.train.progress)
    step = start
    with _Preemption() as preemption:
        for step in range(start + 1, c.train.steps + 1):
            t0 = time.perf_counter()
            if producer is None:
                params = _policy(c, state.params)
                kept, completions, rewards, counts = _draw(c, prompts, rollouts, params, step)
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
                producer.publish(_policy(c, state.params), step)
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


def _evaluate(c: RLConfig, eval_prompts: PromptData, rollouts: _Rollouts, params) -> dict:
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
