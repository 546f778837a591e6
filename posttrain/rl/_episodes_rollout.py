"""Multi-turn rollouts: G episodes of an environment per prompt on the engine, and their rewards."""

from __future__ import annotations

import time

import jax
import numpy as np

from posttrain.envs import (
    Budget,
    ElasticPool,
    episode_metrics,
    make_env,
    rewards_itself,
    run_episodes,
    takes_tool_budget,
)
from posttrain.parallel import tracing
from posttrain.rewards import tally_components
from posttrain.rl._config import EnvConfig


def sample_episodes(rollouts, model, prompts, kwargs, timings, *, shared=None, share=None):
    """Multi-turn: G episodes of `config.env` per prompt on the engine of `rollouts` (a
    `Rollouts`); rewards from the environment, or from the prompt's reward domain for the last
    turn's text. `shared` (an engine spanning processes, `posttrain.envs.Shared`): every
    process runs every episode on the engine, each the environments of its own; `share` (a
    slice of the prompts): score only these in the reward pool (the others' rewards are 0
    here, scored by the processes that own them)."""
    c, e, r = rollouts.config, rollouts.config.env, rollouts.config.rollout
    start = time.perf_counter()
    if rollouts.env_pool is None:
        rollouts.env_pool = ElasticPool(e.workers_min, e.workers_max)
    seeds = kwargs["seeds"]
    if seeds is None:
        keys = jax.vmap(jax.random.fold_in, (None, 0))(
            jax.random.key(kwargs["seed"]), np.arange(len(prompts))
        )
    else:
        keys = jax.vmap(jax.random.key)(np.asarray(seeds, np.uint32))
    keys = np.asarray(jax.random.key_data(keys))  # (host data: used on the sampler's devices)
    G = kwargs["n"]
    groups = [[make_episode_env(e, p["record"], c.train.seed) for _ in range(G)] for p in prompts]
    budget = Budget(
        max_turns=e.max_turns,
        max_tokens=r.max_new_tokens,
        turn_tokens=e.turn_tokens or r.max_new_tokens,
        max_tool_s=e.max_tool_s,
    )
    with rollouts.on_sampler(model.params), tracing.span("generate", prompts=len(prompts), n=G):
        episodes = run_episodes(
            rollouts.engine_for(model),
            rollouts.tokenizer,
            groups,
            keys=keys,
            temperature=kwargs["temperature"],
            top_p=r.sampling.top_p,
            top_k=r.sampling.top_k,
            budget=budget,
            pool=rollouts.env_pool,
            tool_format=e.tool_format,
            shared=shared,
        )
    ran = time.perf_counter()
    flat = [(p, ep) for p, group in zip(prompts, episodes, strict=True) for ep in group]
    rewards = np.zeros(len(flat), np.float32)
    scored = []
    mine = range(len(flat)) if share is None else range(share.start * G, share.stop * G)
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
        elif i in mine:
            scored.append(i)
    if scored:
        with tracing.span("reward", completions=len(scored)):
            results = rollouts.pool.score(
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
