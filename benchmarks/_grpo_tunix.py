"""Tunix's side of benchmarks/rl_vs_peers.py: `tunix.rl.grpo.GRPOLearner` on the shared task.

Runs under its own venv (google-tunix's pins are not ours):

    PYTHONPATH=benchmarks /work/peers/tunix-venv/bin/python benchmarks/_grpo_tunix.py \\
        --spec SPEC --out RESULT

The spec's HF Llama is loaded into Tunix's `Llama3` (`create_model_from_safe_tensors`, float32,
config mapped from config.json as in benchmarks/tunix_sampler.py; RoPE theta must be 1e6, the
one Tunix's Llama3 uses) on a 1x1 ("fsdp", "tp") CPU mesh, shared by the actor trainer and the
vanilla rollout (Tunix's own `Sampler`, KV cache max_prompt_tokens + max_new_tokens), with the
spec's HF tokenizer (transformers). Each RL step takes the next `prompts_per_step` prompt strings
(in order, cycling; the chat template is already applied), samples `group_size` completions of
each (temperature from the spec, top_p 1, no top-k, stop at EOS), scores them with
`_rl_task.digit_share`, and makes one AdamW update (constant rate, no weight decay, no
clipping) on all of them: num_iterations 1, mini batch = full batch, no gradient accumulation,
beta 0 (so no reference model and no separate log-prob pass: the loss uses stop_gradient of
the current log-probs as the old ones), epsilon 0.2, Tunix's default loss aggregation
(sequence-mean-token-mean). No checkpoints, no eval, no metrics backends.

Timing wraps methods on the instances: the step is `RLLearner._run_global_step` (ended by
blocking on the parameters, so that an update still in flight is charged to its own step),
generate_s is `RLCluster.generate` (the whole rollout: tokenizing, prefill, decode, detokenize),
reward_s is `GRPOLearner._compute_rewards`, train_s the rest of the step (padding, advantages,
the update, Tunix's metric buffering).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import os
import time

import _rl_task
from tunix_sampler import _tunix_config  # (stdlib-only module: loads in Tunix's venv)


def digit_reward(prompts, completions, **kwargs) -> list[float]:
    """The shared reward in Tunix's reward_fns signature."""
    return [_rl_task.digit_share(c) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = _rl_task.read_spec(args.spec)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from tunix.models.llama3 import params as llama3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    P, N, G = spec["prompts_per_step"], spec["max_new_tokens"], spec["group_size"]
    steps, seed = spec["steps"], spec["seed"]

    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_id is not None
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = llama3_params.create_model_from_safe_tensors(
            spec["model_dir"], _tunix_config(spec["model_dir"]), mesh=mesh, dtype=jnp.float32
        )
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=N,
        max_prompt_length=spec["max_prompt_tokens"],
        kv_cache_size=spec["max_prompt_tokens"] + N,
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=None,
        seed=seed,
        eos_tokens=[tokenizer.eos_token_id],
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(spec["learning_rate"], weight_decay=0.0),
                eval_every_n_steps=10 * steps,
                max_steps=steps,
                checkpoint_root_directory=None,
                metrics_logging_options=None,
                pbar_description=None,
            ),
            rollout_config=rollout_config,
        ),
    )
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.0),
        reward_fns=[digit_reward],
    )
    assert not learner.should_sync_weights and not learner.can_enable_async_rollout

    # Per-step records, filled by wrappers around the instances' methods.
    rows: list[dict] = []
    trainer = cluster.actor_trainer

    def wrap(obj, name, around):
        inner = getattr(obj, name)
        setattr(obj, name, lambda *a, **k: around(inner, *a, **k))

    def timed_generate(inner, *a, **k):
        rollout_config.seed = seed + len(rows) - 1  # a fresh key per step (see notes)
        start = time.perf_counter()
        out = inner(*a, **k)
        rows[-1]["generate_s"] += time.perf_counter() - start
        # Tunix returns the tokens before the first EOS; a row shorter than N stopped at one.
        rows[-1]["tokens"] += sum(len(t) + (len(t) < N) for t in out.tokens)
        rows[-1]["completions"] += len(out.tokens)
        return out

    def timed_rewards(inner, *a, **k):
        start = time.perf_counter()
        rewards = inner(*a, **k)
        rows[-1]["reward_s"] += time.perf_counter() - start
        rows[-1]["reward"] = float(np.mean(rewards))
        return rewards

    def counted_update(inner, train_ds, *a, **k):
        before = trainer.train_steps
        rows[-1]["update_rows"] += [int(ex.completion_ids.shape[0]) for ex in train_ds]
        inner(train_ds, *a, **k)
        rows[-1]["updates"] += trainer.train_steps - before

    def timed_step(inner, *a, **k):
        rows.append(dict(generate_s=0.0, reward_s=0.0, tokens=0, completions=0, updates=0))
        rows[-1]["update_rows"] = []
        start = time.perf_counter()
        inner(*a, **k)
        jax.block_until_ready(nnx.state(trainer.model, nnx.Param))
        rows[-1]["step_s"] = time.perf_counter() - start

    wrap(cluster, "generate", timed_generate)
    wrap(learner, "_compute_rewards", timed_rewards)
    wrap(cluster, "update_actor", counted_update)
    wrap(learner, "_run_global_step", timed_step)

    prompts = itertools.cycle(spec["prompts"])
    batches = [{"prompts": np.array([next(prompts) for _ in range(P)])} for _ in range(steps)]
    learner.train(batches)

    assert len(rows) == steps, len(rows)
    for row in rows:
        assert row["updates"] == 1 and row["update_rows"] == [P * G], row
        assert row["completions"] == P * G, row
    assert trainer.train_steps == steps, trainer.train_steps
    timed = rows[spec["warmup"] :]
    mean = lambda key: float(np.mean([r[key] for r in timed]))  # noqa: E731
    version = importlib.metadata.version("google-tunix")
    _rl_task.write_result(args.out, {
        "implementation": "tunix GRPOLearner",
        "version": f"google-tunix {version}, jax {jax.__version__}",
        "steps_timed": len(timed),
        "step_s": mean("step_s"),
        "generate_s": mean("generate_s"),
        "reward_s": mean("reward_s"),
        "train_s": mean("step_s") - mean("generate_s") - mean("reward_s"),
        "completion_tokens": mean("tokens"),
        "rewards": [r["reward"] for r in rows],
        "notes": (
            "vanilla rollout (Tunix Sampler: static batch of all completions, left-padded "
            "prompts, decode runs until every row has hit EOS or the budget); actor and rollout "
            "share one model on one CPU device, so rollout and training alternate (no async "
            "prefetch); beta 0: no reference model; num_iterations 1: no old-log-prob pass, "
            "the one forward/backward of the update is the only train-side model pass; loss "
            "sequence-mean-token-mean; Tunix trims each completion at its first EOS and masks "
            "by pad id, so the EOS token itself (and any sampled pad-id token) is not in the "
            "loss; the rollout seed is spec seed + step (Tunix's RolloutConfig.seed alone would "
            "reuse one key every step); each step ends by blocking on the parameters"
        ),
    })  # fmt: skip


if __name__ == "__main__":
    main()
