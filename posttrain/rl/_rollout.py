"""Rollouts: sampling and scoring prompt groups (`Rollouts`, `draw_groups`, the decoupled
`RolloutProducer`) and turning them into fixed-shape training arrays (`rollout_batch`).

Each prompt has `G` sampled completions (multi-turn: `G` episodes); its group occupies `G`
consecutive rows. A row holds `prompt + completion` (right-padded to `max_len`), with the loss
mask on the positions whose target is a completion token (the EOS that ended it included; an
episode's observation tokens excluded) and the sampler's log-prob of each such target. Rows of
groups that were dropped or never filled (dynamic sampling) are
fillers: no tokens, no loss, domain id -1.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from posttrain.data import ImageSpec, pixel_rows, prompt_image_spec, prompt_pixels
from posttrain.envs import (
    Budget,
    ElasticPool,
    episode_metrics,
    make_env,
    rewards_itself,
    run_episodes,
    takes_tool_budget,
)
from posttrain.lora import param_bytes
from posttrain.models import Transformer
from posttrain.rewards import (
    overlong_penalty,
)
from posttrain.rl._config import EnvConfig, RLConfig
from posttrain.rl._domains import component_means, tally_components
from posttrain.rl._sampler_weights import SamplerSide
from posttrain.rl._shares import gather_groups, prompt_share
from posttrain.sampling import (
    Completion,
    Engine,
    EngineConfig,
    generate_continuous,
    generate_static,
)


def rollout_batch(
    prompts: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[Completion]],
    rewards: np.ndarray,
    *,
    groups: int,
    max_len: int,
    pad_id: int = 0,
    route_shape: tuple[int, int] | None = None,
    images: ImageSpec | None = None,
) -> dict[str, np.ndarray]:
    """Arrays for `groups` groups of `G = len(completions[0])` rows (fillers past the data).

    Args:
      prompts: `PromptData` prompts (`prompt_ids`, `domain_id`), one per group.
      completions: per prompt, its G completions.
      rewards: `[len(prompts), G]` scalar rewards.
      groups: groups in the batch (its rows = groups * G).
      max_len: row length; prompt + completion must fit.
      pad_id: the token id of padding.
      route_shape: router replay: `(MoE layers, top-k)` of the completions' `routed_experts`,
        laid out by position as `routed_experts` (int16 `[rows, max_len, *route_shape]`, -1
        where nothing was sampled); None: no routing.
      images: a VLM's: each row gets its prompt's images (`images` float32
        `[rows, max_images, S, S, C]`, zeros in unused slots and on fillers).

    Returns:
      `tokens`, `targets`, `positions`, `segment_ids` (int32) and `loss_mask`,
      `sampler_logps` (float32), each `[rows, max_len]`; `rewards`, `lengths` (completion
      tokens), `truncated` (1.0 where the completion hit max_new_tokens) as float32 `[rows]`;
      `domain_ids` (int32 `[rows]`, -1 on fillers).
    """
    if len(prompts) > groups:
        raise ValueError(f"{len(prompts)} prompt groups do not fit a batch of {groups}")
    G = len(completions[0]) if completions else 1
    rows = groups * G
    out = {k: np.zeros((rows, max_len), np.int32) for k in ("tokens", "targets", "positions")}
    out["tokens"][:] = pad_id
    out["segment_ids"] = np.zeros((rows, max_len), np.int32)
    out["loss_mask"] = np.zeros((rows, max_len), np.float32)
    out["sampler_logps"] = np.zeros((rows, max_len), np.float32)
    for k in ("rewards", "lengths", "truncated"):
        out[k] = np.zeros(rows, np.float32)
    out["domain_ids"] = np.full(rows, -1, np.int32)
    if route_shape is not None:
        out["routed_experts"] = np.full((rows, max_len, *route_shape), -1, np.int16)
    for g, (prompt, group) in enumerate(zip(prompts, completions, strict=True)):
        if len(group) != G:
            raise ValueError(f"prompt {g} has {len(group)} completions, expected {G}")
        for j, c in enumerate(group):
            r = g * G + j
            # An episode (multi-turn) has its own prompt (rendered with its tools) and a mask
            # that leaves the environment's tokens out of the loss.
            p = getattr(c, "prompt_ids", None) or prompt["prompt_ids"]
            ids = [*p, *c.token_ids]
            n = len(ids)
            if n > max_len:
                raise ValueError(f"prompt + completion has {n} tokens, more than max_len={max_len}")
            out["tokens"][r, :n] = ids
            out["targets"][r, : n - 1] = ids[1:]
            out["positions"][r, :n] = np.arange(n)
            out["segment_ids"][r, :n] = 1
            # Position t predicts token t + 1: the completion's tokens are targets from the
            # prompt's last position on.
            k = len(c.token_ids)
            mask = getattr(c, "mask", None)
            out["loss_mask"][r, len(p) - 1 : len(p) - 1 + k] = 1.0 if mask is None else mask
            out["sampler_logps"][r, len(p) - 1 : len(p) - 1 + k] = c.logprobs
            out["rewards"][r] = rewards[g][j]
            out["lengths"][r] = k
            out["truncated"][r] = float(c.truncated)
            out["domain_ids"][r] = prompt["domain_id"]
            if route_shape is not None:
                if c.routed_experts is None or len(c.routed_experts) != n:
                    raise ValueError(f"completion {j} of prompt {g} has no routing for each token")
                out["routed_experts"][r, :n] = c.routed_experts
    if images is not None:  # each row its prompt's images; fillers none
        out["images"] = pixel_rows([prompt_pixels(p, images) for p in prompts for _ in range(G)],
                                   images, rows)  # fmt: skip
    return out


def split_rows(batch: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """`parts` mini-batches of the rows (every parts-th row, so each mixes many groups)."""
    return [{k: v[i::parts] for k, v in batch.items()} for i in range(parts)]


class Rollouts:
    """Sampling and scoring of prompt batches with the current weights."""

    def __init__(
        self, config: RLConfig, tokenizer, model_config, pool, domains, channel="rollouts"
    ):
        self.config, self.tokenizer, self.model_config = config, tokenizer, model_config
        self.pool, self.domains = pool, domains
        self.max_len = config.rollout.max_prompt_len + config.rollout.max_new_tokens
        # Several processes: the name under which they exchange the sampled groups (one per
        # thread that samples: the processes' n-th exchanges on a channel meet).
        self.channel = channel
        self.engine = None  # the paged engine, made at the first sampling (on its devices)
        r = config.rollout
        self.images = prompt_image_spec(
            model_config.vision, tokenizer, r.max_prompt_len, config.data.max_images
        )
        self.env_pool = None  # multi-turn: where environments run (made at the first episodes)

    def sample(
        self,
        params,
        prompts,
        seed: int = 0,
        *,
        seeds=None,
        greedy: bool = False,
        timings=None,
        label: str = "",
    ):
        """(completions per prompt, rewards `[prompts, n]`); adds the seconds spent to
        `timings["generate_s"]` and `timings["reward_s"]` when given.

        `seeds` (one per prompt, instead of `seed`) make each prompt's samples its own, which
        is how several processes share the prompts: each samples and scores its share with its
        own copy of the weights (`SamplerWeights`), and every process gets all of them back
        through the host (`gather_groups`; `label` names the exchange, e.g. "step 3 attempt 0",
        and must be the same on every process). There `timings` also gets each process's mean
        completion length (`response_length/process<i>`).
        """
        # Sampling issues many small device calls, a number that depends on the rows (their
        # lengths, EOS). Whatever the trainer queued before (its step, the copy of the weights
        # to each process) finishes first: XLA:CPU stalls a device's queue once it holds 32
        # programs, and a stalled launch of a program spanning processes (or devices) while
        # its other parts wait for it deadlocks the run.
        jax.block_until_ready(params)
        if jax.process_count() == 1:
            return self._sample(params, prompts, seed, seeds, greedy, timings)
        if self.config.env.name:
            raise ValueError("multi-turn episodes (env.name) run in one process for now")
        if seeds is None and not greedy:
            raise ValueError("sampling across processes needs a seed per prompt (seeds)")
        share = prompt_share(len(prompts))
        completions, rewards = [], np.zeros((0, 0), np.float32)
        if share.stop > share.start:
            with jax.set_mesh(_mesh_of(params)):  # (the sampler's own devices)
                completions, rewards = self._sample(
                    params, prompts[share], seed, seeds and seeds[share], greedy, timings
                )
        G = 1 if greedy else self.config.rollout.num_generations
        label = f"{label or 'sampling'}: {len(prompts)} prompts x {G}"
        out = gather_groups(
            completions, rewards, len(prompts), G, channel=self.channel, label=label
        )
        if timings is not None:
            for p in range(jax.process_count()):
                mine = [c for group in out[0][prompt_share(len(prompts), p)] for c in group]
                key = f"response_length/process{p}"
                timings[key] = timings.get(key, 0.0) + sum(len(c.token_ids) for c in mine)
                timings[f"n:{key}"] = timings.get(f"n:{key}", 0) + len(mine)
        return out

    def _sample(self, params, prompts, seed, seeds, greedy, timings):
        r = self.config.rollout
        start = time.perf_counter()
        model = Transformer(params, self.model_config)
        kwargs = dict(
            max_new_tokens=r.max_new_tokens,
            temperature=0.0 if greedy else r.sampling.temperature,
            top_p=r.sampling.top_p,
            top_k=r.sampling.top_k,
            n=1 if greedy else r.num_generations,
            seed=seed,
            seeds=seeds,
        )
        prompt_ids = [p["prompt_ids"] for p in prompts]
        if self.config.env.name:
            return self._episodes(model, prompts, kwargs, timings)
        if self.images is not None:
            kwargs["images"] = [prompt_pixels(p, self.images) for p in prompts]
        if r.sampler == "static":
            completions = generate_static(model, self.tokenizer, prompt_ids, **kwargs)
        else:
            self.engine_for(model)
            before = dataclasses.replace(self.engine.stats)
            completions = generate_continuous(
                model, self.tokenizer, prompt_ids, engine=self.engine, **kwargs
            )
            if timings is not None:  # prefix sharing: a group's prompt is prefilled once
                for key in ("prompt_tokens", "prefill_tokens"):
                    done = getattr(self.engine.stats, key) - getattr(before, key)
                    timings[key] = timings.get(key, 0) + done
        generated = time.perf_counter()
        rewards = self.score(prompts, completions, shaped=not greedy, timings=timings)
        if timings is not None:
            timings["generate_s"] = timings.get("generate_s", 0.0) + generated - start
            timings["reward_s"] = timings.get("reward_s", 0.0) + time.perf_counter() - generated
        return completions, rewards

    def score(self, prompts, completions, shaped: bool = True, timings=None) -> np.ndarray:
        """Rewards `[prompts, n]` of each prompt's completions from its domain's reward
        functions (with DAPO's over-length shaping when `shaped` and configured); their reward
        components are tallied into `timings` when given (`tally_components`)."""
        r = self.config.rollout
        records = [p["record"] for p in prompts for _ in completions[0]]
        texts = [c.text for group in completions for c in group]
        domains = [p["domain"] for p in prompts for _ in completions[0]]
        results = self.pool.score(records, texts, domains)
        if timings is not None:
            tally_components(timings, results)
        rewards = np.asarray([res.score for res in results], np.float32)
        rewards = rewards.reshape(len(prompts), len(completions[0]))
        if r.overlong_buffer and shaped:
            lengths = np.asarray([[len(c.token_ids) for c in g] for g in completions])
            rewards = rewards + overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer)
        return rewards

    def engine_for(self, model) -> Engine:
        """The paged engine, made at the first sampling, with `model`'s weights swapped in."""
        r = self.config.rollout
        if self.engine is None:
            # By default every sample of a step decodes at once, as in the static sampler
            # (partial rollouts keep twice that in flight).
            groups = self.config.data.batch_size * (2 if r.partial else 1)
            slots = r.engine_slots or groups * r.num_generations
            config = EngineConfig(
                slots=slots,
                block_size=r.kv_block_size,
                kv_dtype=r.kv_dtype,
                unstack_layers=r.unstack_layers,
                record_routes=self.config.loss.router_replay != "off",
            )
            self.engine = Engine(model, config, max_len=self.max_len)
        self.engine.model = model
        return self.engine

    def _episodes(self, model, prompts, kwargs, timings):
        """Multi-turn: G episodes of `config.env` per prompt on the engine; rewards from the
        environment, or from the prompt's reward domain for the last turn's text."""
        c, e, r = self.config, self.config.env, self.config.rollout
        start = time.perf_counter()
        if self.env_pool is None:
            self.env_pool = ElasticPool(e.workers_min, e.workers_max)
        seeds = kwargs["seeds"]
        if seeds is None:
            keys = jax.vmap(jax.random.fold_in, (None, 0))(
                jax.random.key(kwargs["seed"]), np.arange(len(prompts))
            )
        else:
            keys = jax.vmap(jax.random.key)(np.asarray(seeds, np.uint32))
        G = kwargs["n"]
        groups = [
            [make_episode_env(e, p["record"], c.train.seed) for _ in range(G)] for p in prompts
        ]
        budget = Budget(
            max_turns=e.max_turns,
            max_tokens=r.max_new_tokens,
            turn_tokens=e.turn_tokens or r.max_new_tokens,
            max_tool_s=e.max_tool_s,
        )
        episodes = run_episodes(
            self.engine_for(model),
            self.tokenizer,
            groups,
            keys=keys,
            temperature=kwargs["temperature"],
            top_p=r.sampling.top_p,
            top_k=r.sampling.top_k,
            budget=budget,
            pool=self.env_pool,
            tool_format=e.tool_format,
        )
        ran = time.perf_counter()
        flat = [(p, ep) for p, group in zip(prompts, episodes, strict=True) for ep in group]
        rewards = np.zeros(len(flat), np.float32)
        scored = []
        own = rewards_itself(e.name)  # its records need no reward domain: never the pool
        for i, (_, ep) in enumerate(flat):
            if ep.truncated and e.truncated_reward is not None:
                rewards[i] = e.truncated_reward
            elif ep.reward is not None:
                rewards[i] = ep.reward
            elif own and ep.truncated:
                rewards[i] = 0.0  # cut by a budget before the environment scored it
            elif own:
                raise ValueError(
                    f"environment {e.name!r} is registered with rewards=True but ended an "
                    "episode without a reward (Step.reward=None); return the episode's reward "
                    "when done, or register it without rewards=True to score by domain"
                )
            else:
                scored.append(i)
        if scored:
            results = self.pool.score(
                [flat[i][1].record for i in scored],
                [flat[i][1].text for i in scored],
                [flat[i][0]["domain"] for i in scored],
            )
            rewards[scored] = [res.score for res in results]
            if timings is not None:
                tally_components(timings, results)
        # Per-turn rewards an environment reports add to its episode's (advantages are per
        # episode: every token of a group's episode shares its advantage).
        rewards += np.asarray([sum(ep.turn_rewards) for _, ep in flat], np.float32)
        if timings is not None:
            timings["generate_s"] = timings.get("generate_s", 0.0) + ran - start
            timings["reward_s"] = timings.get("reward_s", 0.0) + time.perf_counter() - ran
            timings.update(episode_metrics([ep for _, ep in flat]))
        return episodes, rewards.reshape(len(prompts), G)

    def close(self) -> None:
        if self.env_pool is not None:
            self.env_pool.close()


def make_episode_env(e: EnvConfig, record, seed: int):
    """A new environment of `e` for one episode of `record` (with faults, if configured); an
    environment that stops its own calls gets the episode's tool seconds (`e.max_tool_s`)."""
    options = dict(e.options)
    if takes_tool_budget(e.name):
        options.setdefault("max_tool_s", e.max_tool_s)
    if e.fault_rate > 0:
        return make_env(
            "fault_injection", record, inner=e.name, rate=e.fault_rate, seed=seed, **options
        )
    return make_env(e.name, record, **options)


def _mesh_of(params):
    return jax.tree.leaves(params)[0].sharding.mesh


def draw_groups(c: RLConfig, prompts, rollouts: Rollouts, params, step: int):
    """This step's prompt groups with their completions and rewards (refilled when dynamic
    sampling drops groups with no learning signal) and the counts behind it."""
    groups = c.data.batch_size
    kept, completions, rewards = [], [], []
    drawn = dropped = 0
    timings: dict[str, float] = {}
    for attempt in range(1 + (c.rollout.max_refills if c.rollout.dynamic_sampling else 0)):
        batch = next(prompts)
        drawn += len(batch)
        # Per prompt: the same samples however the prompts are split across processes.
        seeds = [
            int(np.random.SeedSequence([c.train.seed, step, attempt, i]).generate_state(1)[0])
            for i in range(len(batch))
        ]
        comps, rews = rollouts.sample(
            params, batch, seeds=seeds, timings=timings, label=f"step {step} attempt {attempt}"
        )
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
    counts = {"prompts_drawn": drawn, "groups_dropped": dropped, **component_means(timings)}
    return kept, completions, all_rewards, counts


class RolloutProducer:
    """Decoupled rollouts: a thread samples and scores batches on the sampler's devices with the
    newest weights it was sent, at most `rollout.max_staleness` steps ahead of the trainer.

    Batch i (for RL step i) needs weights of version >= i - 1 - max_staleness (version v: the
    weights after v RL steps); with 0 it waits for the step before, which is on-policy.
    """

    def __init__(self, c: RLConfig, prompts, rollouts: Rollouts, side: SamplerSide, start: int):
        self.c, self.prompts, self.rollouts, self.side = c, prompts, rollouts, side
        self.sync_bytes = 0  # bytes sent to the sampler per published version
        self.ready: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.weights, self.version, self.stopped = None, -1, False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(start + 1,), daemon=True)
        self.started = False

    def publish(self, params, version: int) -> None:
        """Sends what the sampler needs of the trained params (after `version` RL steps) to
        its devices, resharding them onto its mesh."""
        sent = self.side.published(params)
        self.sync_bytes = param_bytes(sent)
        weights = jax.device_put(sent, self.side.shardings)
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
        counts = {
            **counts,
            "rollout_version": float(version),
            "staleness": float(staleness),
            "sync_bytes": float(self.sync_bytes),
        }
        return kept, completions, rewards, counts, state

    def _run(self, first: int) -> None:
        prepared, prepared_version = None, None
        try:
            for i in itertools.count(first):
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.stopped or self.version >= i - 1 - self.c.rollout.max_staleness  # noqa: B023
                    )
                    if self.stopped:
                        return
                    weights, version = self.weights, self.version
                if version != prepared_version:
                    prepared, prepared_version = self.side.prepare(weights), version
                kept, completions, rewards, counts = draw_groups(
                    self.c, self.prompts, self.rollouts, prepared, i
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
