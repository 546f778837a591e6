"""Offline RL before online RL: the policy learns from logged trajectories (another policy's,
or an earlier run's), so online RL starts from a better policy and needs fewer samples.

A logged row is `{"prompt": str or messages, "completion": str or messages, "reward": float,
"logprobs"?: [one per completion token], "logprob"?: their sum, "group"?: id}` in JSONL or
Parquet (read with `posttrain.data`'s record readers and encoded as prompt-completion SFT
records: the trained tokens are the completion's, with EOS or the end-of-turn tokens). Each
row's advantage is its reward minus a baseline: the mean reward of its group (the rows sharing
`group`, by default the same prompt) when the group holds two or more rows, else the mean of
the whole log. `grpo_is` also divides by the group's (or log's) reward std, as GRPO does.

The stage is an ordinary run of the shared `train` in `<workdir>/offline` (its own metrics
and checkpoints); online RL then starts from its last checkpoint. A finished stage is reused
on resume; a preempted one resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import paths
from posttrain.config import ConfigError
from posttrain.data import (
    RecordError,
    Records,
    Tokenizer,
    canonical_identity,
    decode,
    encode_record,
    index_mixture,
    to_example,
)
from posttrain.lora import Policy
from posttrain.losses import aggregate, awr_loss, token_stats, truncated_is_loss
from posttrain.models import ModelConfig, ModelSpec, finished_step
from posttrain.parallel import axis_rules
from posttrain.rl import OfflineConfig, RLConfig
from posttrain.train import (
    StepPlan,
    add_moe_aux,
    base_inputs,
    lora_json,
    policy_trainable,
    setup,
    to_json,
    train,
)

log = logging.getLogger(__name__)
_KEPT_ERRORS = 10


def logged_advantages(
    rewards: np.ndarray,
    groups: list[str],
    *,
    scale: bool,
    unbiased_std: bool = True,
    std_eps: float = 1e-4,
) -> np.ndarray:
    """Each row's reward minus its baseline: its group's mean reward when the group holds two
    or more rows, else the mean over all rows; with `scale` (GRPO) divided by the same set's
    std plus `std_eps` (Bessel's std with `unbiased_std`). A set whose rewards are all equal
    gives exactly 0."""
    rewards = np.asarray(rewards, np.float64)

    def centred(r: np.ndarray, pool: np.ndarray) -> np.ndarray:
        if pool.max() == pool.min():
            return np.zeros_like(r)
        out = r - pool.mean()
        if scale:
            dof = len(pool) - 1 if unbiased_std and len(pool) > 1 else len(pool)
            out = out / (np.sqrt(np.sum((pool - pool.mean()) ** 2) / dof) + std_eps)
        return out

    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = np.zeros(len(rewards))
    singles = [m[0] for m in members.values() if len(m) == 1]
    for rows in members.values():
        if len(rows) > 1:
            out[rows] = centred(rewards[rows], rewards[rows])
    if singles:
        out[singles] = centred(rewards[singles], rewards)
    return out.astype(np.float32)


class LoggedTrajectories:
    """This process's stream of offline batches (every row of the log once per epoch, each
    epoch reshuffled; the position is saved with checkpoints): its part of the global batch of
    `rows`, the same global batches on any number of processes. Each batch holds its rows of
    `max_len` tokens: `tokens`, `targets`, `loss_mask` (the completion's tokens), `positions`,
    `segment_ids`, `behaviour_logps` (the logged log-prob of each trained token, 0 without),
    `advantages [rows]` and `geometric [rows]` (1 where only the total log-prob was logged).

    Attributes:
      stats: read, used, malformed, overlong (longer than `max_len`), groups (of 2+ rows),
        with_logprobs, mean_reward and the first errors.
    """

    def __init__(self, c: RLConfig, tokenizer: Tokenizer, *, rows: int, max_len: int):
        o = c.offline
        pi, pc = jax.process_index(), jax.process_count()
        if rows % pc:
            raise ConfigError(f"offline.batch_size={rows} does not divide over {pc} processes")
        self.rows, self.max_len, self.pad_id = rows // pc, max_len, tokenizer.pad_id or 0
        counts = dict.fromkeys(("read", "used", "malformed", "overlong"), 0)
        errors: list[str] = []
        self._examples: list[dict[str, np.ndarray]] = []
        rewards, groups, geometric, missing = [], [], [], []
        records = [Records(p) for p in o.data]
        for recs in records:
            for i in range(len(recs)):
                raw, where = recs[i]
                counts["read"] += 1
                try:
                    record = decode(raw)
                    reward = _reward(record)
                    ids, trained = encode_record(
                        record, "prompt_completion", tokenizer, add_eos=c.data.add_eos
                    )
                    if len(ids) > max_len:
                        counts["overlong"] += 1
                        continue
                    example = to_example(ids, trained)
                    example["behaviour_logps"], summed = _behaviour(record, example["loss_mask"])
                except RecordError as e:
                    if c.data.on_error == "raise":
                        raise RecordError(
                            f"{where}: {e}. Fix the record, or set data.on_error='skip' to skip "
                            "and count bad rows."
                        ) from None
                    counts["malformed"] += 1
                    if len(errors) < _KEPT_ERRORS:
                        errors.append(f"{where}: {e}")
                    continue
                if summed is None:
                    missing.append(where)
                counts["used"] += 1
                self._examples.append(example)
                rewards.append(reward)
                group = record.get("group", record["prompt"])
                groups.append(json.dumps(group, sort_keys=True))
                geometric.append(float(bool(summed)))
        if not self._examples:
            raise ValueError(
                f"no usable row in offline.data {list(o.data)} (counts {counts}; rows must fit "
                f"rollout.max_prompt_len + rollout.max_new_tokens = {max_len}); first errors: "
                f"{errors[:3]}"
            )
        if o.objective == "grpo_is" and missing:
            raise ConfigError(
                f"offline.objective='grpo_is' needs the behaviour policy's log-probs, but "
                f"{len(missing)} of {counts['used']} rows have neither 'logprobs' (one per "
                f"completion token) nor 'logprob' (their sum), e.g. {missing[0]}; log them or "
                "use offline.objective='awr'"
            )
        if skipped := {k: counts[k] for k in ("malformed", "overlong") if counts[k]}:
            log.warning("offline RL left out %s of %d logged rows", skipped, counts["read"])
        a = c.algorithm
        self._advantages = logged_advantages(
            np.asarray(rewards),
            groups,
            scale=o.objective == "grpo_is",
            unbiased_std=a.unbiased_std,
            std_eps=a.std_eps,
        )
        self._geometric = np.asarray(geometric, np.float32)
        sizes: dict[str, int] = {}
        for g in groups:
            sizes[g] = sizes.get(g, 0) + 1
        self.stats = {
            **counts,
            "groups": sum(n > 1 for n in sizes.values()),
            "with_logprobs": counts["used"] - len(missing),
            "mean_reward": float(np.mean(rewards)),
            "errors": errors,
        }
        self._identity = canonical_identity(
            {
                "data": list(o.data),
                "records": [len(r) for r in records],
                "objective": o.objective,
                "max_len": max_len,
                "process": [pi, pc],
                "rows": counts["used"],
                "seed": c.data.seed,
            }
        )
        # Every process draws the same global batches (all `rows`) and collates its own
        # contiguous part of each: the run trains on the batches one process would.
        members = list(range(len(self._examples)))
        indices = index_mixture([members], [1.0], seed=c.data.seed, shuffle=True, num_epochs=None)
        mine = slice(pi * self.rows, (pi + 1) * self.rows)
        self._iterator = indices.batch(
            rows, batch_fn=lambda ix: self._collate(list(ix)[mine])
        ).__iter__()

    def _collate(self, indices) -> dict[str, np.ndarray]:
        n, length = len(indices), self.max_len
        batch = {
            "tokens": np.full((n, length), self.pad_id, np.int32),
            "targets": np.zeros((n, length), np.int32),
            "loss_mask": np.zeros((n, length), np.float32),
            "positions": np.zeros((n, length), np.int32),
            "segment_ids": np.zeros((n, length), np.int32),
            "behaviour_logps": np.zeros((n, length), np.float32),
        }
        for row, i in enumerate(indices):
            example = self._examples[i]
            size = len(example["tokens"])
            for key in ("tokens", "targets", "loss_mask", "behaviour_logps"):
                batch[key][row, :size] = example[key]
            batch["positions"][row, :size] = np.arange(size)
            batch["segment_ids"][row, :size] = 1
        batch["advantages"] = self._advantages[list(indices)]
        batch["geometric"] = self._geometric[list(indices)]
        return batch

    def __iter__(self) -> LoggedTrajectories:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return {"pipeline": self._identity, "iterator": self._iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if canonical_identity(state.get("pipeline", {})) != self._identity:
            raise ValueError(
                "the offline stage's data state was saved with other logged data or settings "
                f"(saved {state.get('pipeline')}, now {self._identity}); restore them, or delete "
                "<workdir>/offline to run the stage afresh"
            )
        self._iterator.set_state(state["iterator"])


def _reward(record) -> float:
    reward = record.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise RecordError(f"'reward' must be a number, got {reward!r}")
    if not math.isfinite(reward):
        raise RecordError(f"'reward' must be finite, got {reward}")
    return float(reward)


def _behaviour(record, loss_mask_L: np.ndarray) -> tuple[np.ndarray, bool | None]:
    """The logged log-prob of each trained token `[L]`, and whether it was logged as a total
    (spread evenly over the tokens); None when the record has neither."""
    out = np.zeros(len(loss_mask_L), np.float32)
    trained = np.flatnonzero(loss_mask_L)
    if "logprobs" in record:
        values = record["logprobs"]
        if not isinstance(values, list | tuple | np.ndarray) or len(values) != len(trained):
            size = len(values) if isinstance(values, list | tuple | np.ndarray) else values
            raise RecordError(
                f"'logprobs' must hold one log-prob per trained completion token ({len(trained)} "
                f"as this tokenizer encodes the completion, with its EOS / end-of-turn), got "
                f"{size}"
            )
        values = np.asarray(values, np.float64)
        summed = False
    elif "logprob" in record:
        total = record["logprob"]
        if isinstance(total, bool) or not isinstance(total, int | float):
            raise RecordError(f"'logprob' must be a number, got {total!r}")
        values = np.full(len(trained), total / len(trained))
        summed = True
    else:
        return out, None
    if not (np.all(np.isfinite(values)) and np.all(values <= 0)):
        raise RecordError("logged log-probs must be finite and <= 0")
    out[trained] = values
    return out, summed


def offline_loss(
    model_config: ModelConfig,
    o: OfflineConfig,
    *,
    aggregation: str,
    max_new_tokens: int,
    policy: Policy | None = None,
):
    """`(params, batch, rng) -> sums` of the offline objective (`o.objective`), aggregated as
    the online loss is (`aggregation`, the Dr.GRPO normaliser `max_new_tokens`).

    Metrics (train_step's `X_sum / X_count`), over the weight's units (AWR: completions,
    grpo_is: tokens): `weight` (mean), `weight_clipped` (share at the cap), `ess` (the
    effective sample size over the units, `(sum w)^2 / (n sum w^2)` in (0, 1], per
    micro-batch), `advantage` (mean per completion) and for grpo_is `ratio` (mean pi / mu).
    """
    policy = policy or Policy()

    def loss_fn(params, batch, rng):
        del rng
        model_params, hidden, aux = policy.forward(params, batch, model_config)
        logp = token_stats(model_params, hidden, batch["targets"], model_config)["logp"]
        mask, advantages = batch["loss_mask"], batch["advantages"]
        rows = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
        sums = {}
        if o.objective == "awr":
            out = awr_loss(logp, advantages, mask, beta=o.beta, max_weight=o.max_weight)
            units = rows
        else:
            out = truncated_is_loss(
                logp,
                batch["behaviour_logps"],
                advantages,
                mask,
                cap=o.tis_cap,
                geometric_B=batch["geometric"],
            )
            units = mask
            sums.update(_mean("ratio", out["ratio"], units))
        numerator, normaliser = aggregate(out["losses"], mask, aggregation, max_len=max_new_tokens)
        w = out["weights"] * units
        n = jnp.sum(units)
        ess = jnp.square(jnp.sum(w)) / jnp.maximum(n * jnp.sum(jnp.square(w)), 1e-30)
        sums.update(
            {
                "loss_sum": numerator,
                "num_tokens": normaliser,
                **_mean("weight", out["weights"], units),
                **_mean("weight_clipped", out["clipped"], units),
                **_mean("advantage", advantages, rows),
                "ess_sum": jnp.where(n > 0, ess, 0.0),
                "ess_count": (n > 0).astype(jnp.float32),
            }
        )
        return add_moe_aux(sums, aux)

    return loss_fn


def _mean(name: str, values, units) -> dict[str, jax.Array]:
    return {f"{name}_sum": jnp.sum(values * units), f"{name}_count": jnp.sum(units)}


def offline_rl(c: RLConfig, workdir: str) -> tuple[RLConfig, dict]:
    """Runs (or resumes, or reuses when finished) the offline stage in `<workdir>/offline`.

    Returns:
      (the RL config continuing from the stage's checkpoint, the stage's summary: its
      `stopped` is "preempted" when SIGTERM saved it mid-stage; run again to go on).
    """
    o = c.offline
    stage_dir = paths.join(workdir, "offline")
    continued = dataclasses.replace(c, model=ModelSpec(checkpoint=stage_dir, **c.model.overrides()))
    if finished_step(stage_dir) >= o.steps:
        log.info("offline RL stage already finished in %s: reusing it", stage_dir)
        return continued, {"stopped": "completed", "final_step": o.steps}
    stage = dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, batch_size=o.batch_size),
        algorithm=dataclasses.replace(c.algorithm, epochs=1, minibatches=1),
        optimizer=dataclasses.replace(c.optimizer, learning_rate=o.learning_rate, warmup_steps=0),
        train=dataclasses.replace(c.train, steps=o.steps, eval_every=0),
        checkpoint=dataclasses.replace(c.checkpoint, every=o.steps, keep_best=0),
    )
    mesh, tokenizer, model_config = setup(stage, stage_dir, rows=o.batch_size)
    max_len = c.rollout.max_prompt_len + c.rollout.max_new_tokens
    data = LoggedTrajectories(c, tokenizer, rows=o.batch_size, max_len=max_len)
    log.info("offline RL (%s) on logged trajectories: %s", o.objective, data.stats)
    paths.write_text(paths.join(stage_dir, "trajectories.json"), json.dumps(data.stats, indent=2))
    extras = {"config": to_json(stage), "model_config": to_json(model_config)}
    inputs, input_sh = {}, {}
    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        if c.lora is not None:
            inputs, input_sh = base_inputs(c.lora, c.model, model_config, mesh, c.train.seed)
            extras["lora"] = lora_json(c.lora, c.model, c.train.seed)

        def loss(frozen: dict):
            return offline_loss(
                model_config,
                o,
                aggregation=c.loss.aggregation,
                max_new_tokens=c.rollout.max_new_tokens,
                policy=Policy(c.lora, frozen.get("base")),
            )

        plan = StepPlan(policy_trainable(stage, model_config, mesh), loss)
    summary = train(
        stage,
        stage_dir,
        mesh=mesh,
        plan=plan,
        data=data,
        loss_inputs=inputs,
        loss_input_shardings=input_sh,
        extras=extras,
    )
    return continued, summary
