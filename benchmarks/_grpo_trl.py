"""TRL's side of benchmarks/rl_vs_peers.py: `trl.GRPOTrainer` on the shared task (its own venv).

The spec's HF directory is the model (float32, CPU) and tokenizer, its prompt strings the data as
the standard (non-conversational) "prompt" column, so TRL applies no chat template; the dataset is
the exact sequence of prompts the steps draw (in order, cycling, no shuffling). Each RL step
samples `group_size` completions for each of `prompts_per_step` prompts with transformers'
`generate` (pure sampling, stop at EOS) and makes one AdamW update on all of them: one micro-batch
of prompts_per_step * group_size, no accumulation, one iteration, no KL, no clipping, constant rate.

The split is timed on the trainer instance: generate_s wraps `_generate` (tokenize, generate,
decode), reward_s wraps `_calculate_rewards`, and train_s is the rest of the step from the
callback's on_step_begin to on_step_end (advantages, the loss's forward/backward, the update).

    PYTHONPATH=benchmarks /work/peers/trl-venv/bin/python benchmarks/_grpo_trl.py --spec S --out R
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _rl_task


def digit_reward(completions: list[str], **kwargs) -> list[float]:
    """The shared reward in TRL's `reward_funcs` signature."""
    return [_rl_task.digit_share(c) for c in completions]


def timed(trainer, name: str, sink: list, after=None) -> None:
    """Replace `trainer.<name>` with a wrapper that adds its wall time to `sink[-1]`."""
    inner = getattr(trainer, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sink[-1] += time.perf_counter() - start
        if after is not None:
            after(out)
        return out

    setattr(trainer, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = _rl_task.read_spec(args.spec)

    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(spec["threads"])
    transformers.set_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])

    per_step, group, steps = spec["prompts_per_step"], spec["group_size"], spec["steps"]
    batch = per_step * group
    prompts = spec["prompts"]
    order = [prompts[i % len(prompts)] for i in range(steps * per_step)]
    dataset = datasets.Dataset.from_dict({"prompt": order})

    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_trl_"),
        max_steps=steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=group,
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=0.0,  # Trainer clips only when > 0
        gradient_checkpointing=False,  # TRL defaults it on
        shuffle_dataset=False,
        seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )

    generate_s, reward_s, step_s, tokens, rewards, updates = [], [], [], [], [], []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            for sink in (generate_s, reward_s, tokens):
                sink.append(0.0)
            updates.append([])
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_s.append(time.perf_counter() - self.start)

    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )

    # _generate returns (prompt_ids, completion_ids, ...): completion ids run up to and
    # including EOS, unpadded; _calculate_rewards returns a (completions, funcs) tensor.
    def count_tokens(out):
        tokens[-1] += sum(len(ids) for ids in out[1])

    def mean_reward(out):
        rewards.append(out[:, 0].mean().item())

    timed(trainer, "_generate", generate_s, count_tokens)
    timed(trainer, "_calculate_rewards", reward_s, mean_reward)
    compute_loss = trainer._compute_loss

    def counted_loss(model, inputs):
        updates[-1].append(inputs["completion_ids"].size(0))
        return compute_loss(model, inputs)

    trainer._compute_loss = counted_loss
    trainer.train()

    assert trainer.state.global_step == steps == len(step_s), (trainer.state.global_step, step_s)
    assert all(u == [batch] for u in updates), f"completions per update: {updates}"
    adam_steps = {int(v["step"]) for v in trainer.optimizer.state.values()}
    assert adam_steps == {steps}, f"optimizer steps: {adam_steps}"
    assert len(rewards) == steps, rewards
    warm = spec["warmup"]
    mean = lambda xs: sum(xs[warm:]) / len(xs[warm:])
    train_s = [s - g - r for s, g, r in zip(step_s, generate_s, reward_s, strict=True)]
    _rl_task.write_result(
        args.out,
        {
            "implementation": "trl GRPOTrainer",
            "version": f"trl {trl.__version__}, torch {torch.__version__}",
            "steps_timed": steps - warm,
            "step_s": mean(step_s),
            "generate_s": mean(generate_s),
            "reward_s": mean(reward_s),
            "train_s": mean(train_s),
            "completion_tokens": mean(tokens),
            "rewards": rewards,
            "notes": (
                "transformers generate (dynamic KV cache, eager PyTorch, no compile) for "
                "rollouts. Advantages are TRL's default scale_rewards='group': (r - group mean) /"
                " (group std + 1e-4). loss_type='grpo': per-token loss averaged over each "
                "completion's tokens, then over completions. With steps_per_generation = "
                "gradient_accumulation_steps = 1 and num_iterations=1, TRL computes no old log-"
                "probs (the ratio is 1 via a detached copy of the current log-probs), so the loss"
                " makes one forward/backward; it also computes per-token entropies in that "
                "forward. generate_s includes prompt tokenization and decoding; train_s includes "
                "advantages and TRL's metric bookkeeping. TRL's default gradient checkpointing is"
                " turned off."
            ),
        },
    )


if __name__ == "__main__":
    main()
