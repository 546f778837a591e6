"""Rollouts: sampling and scoring prompt groups with the current weights (`Rollouts`, on one
process or several) and drawing a step's groups from them (`draw_groups`, dynamic sampling).

The decoupled `RolloutProducer` is in `_rollout_producer.py`, multi-turn episodes in
`_episodes_rollout.py`, the training arrays they become (`rollout_batch`) in `_rollout_batch.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from contextlib import nullcontext

import jax
import numpy as np

from posttrain.data import prompt_image_spec, prompt_pixels
from posttrain.envs import Shared, episode_metrics
from posttrain.models import Transformer
from posttrain.parallel import exchange, mesh_of, tracing
from posttrain.rewards import (
    component_means,
    overlong_penalty,
    tally_components,
)
from posttrain.rl._config import RLConfig
from posttrain.rl._episodes_rollout import sample_episodes
from posttrain.rl._shares import gather_groups, prompt_share
from posttrain.sampling import Completion, Engine, SamplingParams, generate_continuous


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
        if seeds is None and not greedy:
            raise ValueError("sampling across processes needs a seed per prompt (seeds)")
        share = prompt_share(len(prompts))
        before = dict(timings or {})
        G = 1 if greedy else self.config.rollout.num_generations
        label = f"{label or 'sampling'}: {len(prompts)} prompts x {G}"
        episodes = bool(self.config.env.name)
        if self.config.rollout.sampler_mesh == "global":
            out = self._sample_everywhere(params, prompts, seed, seeds, greedy, timings, label)
        else:
            completions, rewards = [], np.zeros((0, 0), np.float32)
            if share.stop > share.start:
                completions, rewards = self._sample(
                    params, prompts[share], seed, seeds and seeds[share], greedy, timings
                )
            out = gather_groups(
                completions, rewards, len(prompts), G, channel=self.channel, label=label,
                episodes=episodes,
            )  # fmt: skip
        if timings is not None:  # reward components: tallied over every process's share
            add_tallies_of_every_process(timings, before, self.channel, label)
        if timings is not None and episodes:  # (over every process's episodes)
            timings.update(episode_metrics([e for group in out[0] for e in group]))
        if timings is not None:
            for p in range(jax.process_count()):
                mine = [c for group in out[0][prompt_share(len(prompts), p)] for c in group]
                key = f"response_length/process{p}"
                timings[key] = timings.get(key, 0.0) + sum(len(c.token_ids) for c in mine)
                timings[f"n:{key}"] = timings.get(f"n:{key}", 0) + len(mine)
        return out

    def _sample(self, params, prompts, seed, seeds, greedy, timings):
        start = time.perf_counter()
        if self.config.env.name:
            model = Transformer(params, self.model_config)
            kwargs = self._episode_settings(seed, seeds, greedy)
            return sample_episodes(self, model, prompts, kwargs, timings)
        completions = self._generate(params, prompts, seed, seeds, greedy, timings)
        generated = time.perf_counter()
        rewards = self.score(prompts, completions, shaped=not greedy, timings=timings)
        _add_seconds(timings, start, generated)
        return completions, rewards

    def _episode_settings(self, seed, seeds, greedy) -> dict:
        """`sample_episodes`' settings: budget, samples per prompt, seeds, sampling."""
        r = self.config.rollout
        sampling = SamplingParams(temperature=0.0) if greedy else r.sampling
        return dict(max_new_tokens=r.max_new_tokens, n=1 if greedy else r.num_generations,
                    seed=seed, seeds=seeds, **dataclasses.asdict(sampling))  # fmt: skip

    def _sample_everywhere(self, params, prompts, seed, seeds, greedy, timings, label):
        """`rollout.sampler_mesh="global"` on several processes: every process runs the engine
        over the training mesh on every prompt, so all get the same completions (its device
        programs span the processes and its host decisions follow their replicated results);
        each scores its share, and the rewards cross through the host. Episodes: each process
        runs its share's environments, and their answers cross after each engine call
        (`posttrain.envs.Shared`)."""
        start, share = time.perf_counter(), prompt_share(len(prompts))
        if self.config.env.name:  # each process runs its share's environments
            rounds = itertools.count()

            def tell(events: list) -> list[list]:
                blob = np.frombuffer(json.dumps(events, default=_plain).encode(), np.uint8)
                theirs = exchange(self.channel, f"{label}: round {next(rounds)}", {"e": blob})
                return [json.loads(t["e"].tobytes()) for t in theirs]

            shared = Shared(lambda g, j: share.start <= g < share.stop, tell)
            model = Transformer(params, self.model_config)
            kwargs = self._episode_settings(seed, seeds, greedy)
            completions, rewards = sample_episodes(
                self, model, prompts, kwargs, timings, shared=shared, share=share
            )
            theirs = exchange(self.channel, f"{label}: rewards", {"scores": rewards[share]})
            return completions, np.concatenate([t["scores"] for t in theirs]).astype(np.float32)
        completions = self._generate(params, prompts, seed, seeds, greedy, timings)
        generated = time.perf_counter()
        G = len(completions[0])
        mine = np.zeros((0, G), np.float32)
        if share.stop > share.start:
            mine = self.score(prompts[share], completions[share], shaped=not greedy,
                              timings=timings)  # fmt: skip
        theirs = exchange(self.channel, f"{label}: rewards", {"scores": mine.reshape(-1, G)})
        rewards = np.concatenate([t["scores"].reshape(-1, G) for t in theirs]).astype(np.float32)
        _add_seconds(timings, start, generated)
        return completions, rewards

    def _generate(self, params, prompts, seed, seeds, greedy, timings):
        """The single-turn completions of `prompts` on the engine (prefill counts added to
        `timings`)."""
        r = self.config.rollout
        model = Transformer(params, self.model_config)
        sampling = SamplingParams(temperature=0.0) if greedy else r.sampling
        n = 1 if greedy else r.num_generations
        images = None
        if self.images is not None:
            images = [prompt_pixels(p, self.images) for p in prompts]
        with self.on_sampler(params), tracing.span("generate", prompts=len(prompts), n=n):
            self.engine_for(model)
            before = dataclasses.replace(self.engine.stats)
            completions = sample_groups(
                self.engine, model, self.tokenizer, prompts, sampling=sampling, n=n,
                max_new_tokens=r.max_new_tokens, seed=seed, seeds=seeds, images=images,
            )  # fmt: skip
        if timings is not None:  # prefix sharing: a group's prompt is prefilled once
            for key in ("prompt_tokens", "prefill_tokens"):
                done = getattr(self.engine.stats, key) - getattr(before, key)
                timings[key] = timings.get(key, 0) + done
        return completions

    def score(self, prompts, completions, shaped: bool = True, timings=None) -> np.ndarray:
        """Rewards `[prompts, n]` of each prompt's completions from its domain's reward
        functions (with DAPO's over-length shaping when `shaped` and configured); their reward
        components are tallied into `timings` when given (`tally_components`)."""
        r = self.config.rollout
        with tracing.span("reward", prompts=len(prompts)):
            results = score_groups(self.pool, prompts, completions)
        if timings is not None:
            tally_components(timings, results)
        rewards = np.asarray([res.score for res in results], np.float32)
        rewards = rewards.reshape(len(prompts), len(completions[0]))
        if r.overlong_buffer and shaped:
            lengths = np.asarray([[len(c.token_ids) for c in g] for g in completions])
            rewards = rewards + overlong_penalty(lengths, r.max_new_tokens, r.overlong_buffer)
        return rewards

    @staticmethod
    def on_sampler(params):
        """On several processes, the context of sampling with `params` (this process's own
        copy): its devices' mesh, not the global one. Rewards are scored outside it (a reward
        model or a judge runs on its own device)."""
        return jax.set_mesh(mesh_of(params)) if jax.process_count() > 1 else nullcontext()

    def engine_for(self, model) -> Engine:
        """The paged engine, made at the first sampling, with `model`'s weights swapped in."""
        r = self.config.rollout
        if self.engine is None:
            # slots 0: every sample of a step decodes at once (partial rollouts keep twice
            # that in flight).
            groups = self.config.data.batch_size * (2 if r.partial else 1)
            config = dataclasses.replace(
                r.engine.sized(groups * r.num_generations),
                record_routes=self.config.loss.router_replay != "off",
            )
            self.engine = Engine(model, config, max_len=self.max_len)
        self.engine.model = model
        return self.engine

    def close(self) -> None:
        if self.env_pool is not None:
            self.env_pool.close()


def _add_seconds(timings, start: float, generated: float) -> None:
    """Adds the seconds spent generating (start to `generated`) and scoring (since) to
    `timings` (when given)."""
    if timings is not None:
        timings["generate_s"] = timings.get("generate_s", 0.0) + generated - start
        timings["reward_s"] = timings.get("reward_s", 0.0) + time.perf_counter() - generated


def _plain(x):
    """A NumPy scalar (or anything else) in an environment's answer, for JSON."""
    return x.item() if hasattr(x, "item") else str(x)


def sample_groups(
    engine: Engine, model, tokenizer, prompts, *, sampling: SamplingParams, n: int,
    max_new_tokens: int, seed: int = 0, seeds=None, images=None,
) -> list[list[Completion]]:  # fmt: skip
    """The n completions of each prompt (its `prompt_ids`) on `engine` with `model`'s weights:
    the single-turn rollout that RL steps, rejection-sampling fine-tuning and the on-policy
    data tools (`data pairs`, `data synth`) share; `seed`/`seeds` key prompt i's samples as
    `generate` does, so a prompt's samples do not depend on the others it is batched with."""
    return generate_continuous(
        model, tokenizer, [p["prompt_ids"] for p in prompts], engine=engine,
        max_new_tokens=max_new_tokens, n=n, seed=seed, seeds=seeds, images=images,
        **dataclasses.asdict(sampling),
    )  # fmt: skip


def score_groups(pool, prompts, completions) -> list:
    """The reward results of every completion (prompt-major, flat), each scored by its prompt's
    domain (`record`, `domain`) in the reward pool: what `sample_groups` returns, scored."""
    n = len(completions[0]) if completions else 0
    return pool.score(
        [p["record"] for p in prompts for _ in range(n)],
        [c.text for group in completions for c in group],
        [p["domain"] for p in prompts for _ in range(n)],
    )


def add_tallies_of_every_process(timings: dict, before: dict, channel: str, label: str) -> None:
    """`timings`' running tallies (a sum `k` beside its count `n:k`, e.g. `reward_parts/...`,
    `reward_errors`) with what the other processes added since `before` added in, so that
    their means are over the whole step, as on one process (through the host)."""
    tallied = [k for k in timings if f"n:{k}" in timings]
    mine = {k: np.float64(timings[k] - before.get(k, 0)) for k in tallied}
    mine.update(
        {f"n:{k}": np.float64(timings[f"n:{k}"] - before.get(f"n:{k}", 0)) for k in tallied}
    )
    for p, theirs in enumerate(exchange(channel, f"{label}: tallies", mine)):
        if p != jax.process_index():
            for k, v in theirs.items():
                timings[k] = timings.get(k, 0) + float(v)


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
