"""Offline stages before online RL, both from the starting policy's samples: difficulty
filtering of the prompts and rejection-sampling fine-tuning (RFT, an SFT run on the completions
that passed), which the RL driver (`_grpo.py`) runs first.

On several processes each samples its share of the prompts with its own copy of the weights
and every process gets every group back (`Rollouts.sample`), so each writes the same stage
files (atomically) and runs the same SFT stage; prompt i draws from its own seed, so the
samples do not depend on how many processes share the prompts."""

import dataclasses
import json
import logging

import jax
import numpy as np
from tqdm.auto import tqdm

from posttrain import paths
from posttrain.data import DataConfig, SourceConfig
from posttrain.methods._sft import SFTConfig, run_sft
from posttrain.models import ModelSpec, param_shardings
from posttrain.parallel import axis_rules, process_meshes, to_process_local
from posttrain.rewards import (
    RewardPool,
    pass_rate,
)
from posttrain.rl import RLConfig, Rollouts
from posttrain.train import model_trainable, to_json

log = logging.getLogger(__name__)
_CHUNK = 64  # prompts per sampling call


def _sample(c: RLConfig, prompts, chosen, samples: int, tokenizer, model_config, mesh, desc):
    """The starting policy's `samples` completions of each `chosen` prompt, scored: yields
    (prompt batch, completions, rewards `[batch, samples]`) for batches of 64 prompts."""
    with axis_rules(c.mesh.axis_rules), jax.set_mesh(mesh):
        params = model_trainable(c.model, model_config, mesh, c.train.seed).init()
        if jax.process_count() > 1 and c.rollout.sampler_mesh == "per_process":
            # (each process samples its share on its own devices)
            local, stacked = process_meshes(mesh.devices.flat)
            params = to_process_local(params, param_shardings(model_config, local), stacked)
    sampling = dataclasses.replace(
        c, rollout=dataclasses.replace(c.rollout, num_generations=samples)
    )
    registry = c.rewards.registry()
    with RewardPool(registry, workers=c.rewards.workers, timeout_s=c.rewards.timeout_s) as pool:
        rollouts = Rollouts(sampling, tokenizer, model_config, pool, prompts.domains)
        bar = tqdm(total=len(chosen), desc=desc, disable=not c.train.progress)
        for i in range(0, len(chosen), _CHUNK):
            batch = chosen[i : i + _CHUNK]
            seeds = [
                int(np.random.SeedSequence([c.train.seed, i + j]).generate_state(1)[0])
                for j in range(len(batch))
            ]
            completions, rewards = rollouts.sample(
                params, batch, seeds=seeds, label=f"{desc}: prompts {i}+"
            )
            bar.update(len(batch))
            yield batch, completions, rewards
        bar.close()


def filter_by_difficulty(c: RLConfig, workdir, prompts, tokenizer, model_config, mesh) -> None:
    """Drops the prompts the starting policy always or never solves (pass rate outside
    (min_pass_rate, max_pass_rate) over `difficulty.samples` samples); the estimates are
    stored in `<workdir>/difficulty.json` and reused on resume."""
    d = c.difficulty
    path = paths.path(workdir) / "difficulty.json"
    count = len(prompts.prompts) if not d.prompts else min(d.prompts, len(prompts.prompts))
    key = {"samples": d.samples, "prompts": count, "model": to_json(c.model)}
    saved = None
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") != json.loads(json.dumps(key)):
            saved = None
    if saved is None:
        scores = {}
        chosen = prompts.prompts[:count]
        sampled = _sample(
            c, prompts, chosen, d.samples, tokenizer, model_config, mesh, "difficulty"
        )
        for _, _, rewards in sampled:
            scores.update({len(scores) + j: r.tolist() for j, r in enumerate(rewards)})
        rates = pass_rate(scores, threshold=c.rewards.pass_threshold)
        saved = {"key": key, "pass_rates": {str(k): v for k, v in rates.items()}}
        paths.write_text(path, json.dumps(saved))
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


def rejection_sampling(c: RLConfig, workdir, prompts, tokenizer, model_config, mesh) -> RLConfig:
    """The offline stage: RFT data from the starting policy, an SFT run on it in
    `<workdir>/rft`, and the RL config continuing from that run's checkpoint. A finished stage
    (its checkpoint exists) is reused, so a resumed run does not repeat it."""
    rft_dir = paths.join(workdir, "rft")
    data_path = paths.join(rft_dir, "data.jsonl")
    checkpoints = paths.path(rft_dir) / "checkpoints"
    done = checkpoints.is_dir() and any(checkpoints.iterdir())
    if not done:
        chosen = prompts.prompts[: c.rft.prompts]
        kept, scored = [], 0
        sampled = _sample(
            c, prompts, chosen, c.rft.samples, tokenizer, model_config, mesh, "rft samples"
        )
        for batch, completions, rewards in sampled:
            for p, group, r in zip(batch, completions, rewards, strict=True):
                passed = [
                    g
                    for g, ok in zip(group, r >= c.rewards.pass_threshold, strict=True)
                    if ok and g.finish_reason == "stop"
                ]
                if c.env.name:  # successful episodes, as multi-turn tool-use chats
                    rows = {json.dumps({"messages": g.messages, "tools": g.tools}) for g in passed}
                    kept.extend(json.loads(row) for row in sorted(rows))
                else:
                    texts = sorted({g.text for g in passed})
                    kept.extend({"prompt": p["record"]["prompt"], "completion": t} for t in texts)
                scored += len(group)
        if not kept:
            raise ValueError(
                f"rejection sampling kept no completion of {scored}: none both ended (EOS within "
                f"rollout.max_new_tokens) and reached rewards.pass_threshold="
                f"{c.rewards.pass_threshold}; lower the threshold, raise rft.samples or "
                "max_new_tokens, or set rft.steps=0"
            )
        paths.write_text(data_path, "".join(json.dumps(r) + "\n" for r in kept))
        log.info("rejection sampling kept %d of %d completions", len(kept), scored)
        kind = "messages" if c.env.name else "prompt_completion"
        sft = SFTConfig(
            model=c.model,
            tokenizer=c.tokenizer,
            data=DataConfig(
                sources=(SourceConfig(data_path, format=kind),),
                max_len=c.rollout.max_prompt_len + c.rollout.max_new_tokens,
                batch_size=c.rft.batch_size,
                seed=c.data.seed,
                split_by="rows",  # (the same SFT batches on any number of processes)
            ),
            optimizer=dataclasses.replace(
                c.optimizer, learning_rate=c.rft.learning_rate, warmup_steps=0
            ),
            train=dataclasses.replace(c.train, steps=c.rft.steps, eval_every=0),
            checkpoint=dataclasses.replace(c.checkpoint, every=c.rft.steps, keep_best=0),
            mesh=c.mesh,
            lora=c.lora,  # with LoRA, RL then starts fresh adapters on the merged result
        )
        run_sft(sft, rft_dir)
    return dataclasses.replace(c, model=ModelSpec(checkpoint=rft_dir, **c.model.overrides()))
