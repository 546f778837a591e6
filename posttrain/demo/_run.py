"""`make demo`: post-training a tiny model on the bundled arithmetic task, on CPU.

Stage 1 (SFT) trains the `tiny` transformer from scratch on addition and subtraction chats and
reports greedy exact-match accuracy on held-out problems before and after. Stage 2 (DPO) samples
the SFT model's answers to training problems, pairs a right with a wrong one (the verifier
labels them) and aligns the model on those pairs, reporting how often it prefers the right
answer of held-out pairs, and its exact match, before and after. Stage 3 (GRPO) trains the SFT
model with reinforcement learning instead, the verifier as the reward, and plots the reward
curve.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import numpy as np

from posttrain.config import load_config_file, override
from posttrain.data import load_tokenizer
from posttrain.demo._task import DOMAIN
from posttrain.eval import greedy_exact_match, prefers_chosen
from posttrain.methods import method_config
from posttrain.models import Transformer, num_params
from posttrain.rewards import integer_correct
from posttrain.sampling import generate
from posttrain.train import read_metrics

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_CONFIG = os.path.join(_REPO, "configs", "sft.py")
DPO_CONFIG = os.path.join(_REPO, "configs", "dpo.py")
GRPO_CONFIG = os.path.join(_REPO, "configs", "grpo.py")
_PAIR_PROBLEMS = 2048  # training problems the SFT model answers to make DPO pairs


def _records(path: str, limit: int | None = None) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit else rows


def plot_loss(workdir: str, out_png: str) -> str:
    """Train loss (and eval loss, if any) against step, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(workdir, "train"), read_metrics(workdir, "eval")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("SFT on the arithmetic task")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_rewards(workdir: str, out_png: str) -> str:
    """RL reward per step (and its moving average, and held-out greedy reward), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(workdir, "train"), read_metrics(workdir, "eval")
    steps = np.asarray([r["step"] for r in train])
    rewards = np.asarray([r["reward"] for r in train])
    window = max(1, len(rewards) // 20)
    smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, rewards, alpha=0.3, label="train reward (sampled)")
    ax.plot(steps[window - 1 :], smooth, label=f"moving average ({window} steps)")
    if evals:
        ax.plot(
            [r["step"] for r in evals],
            [r["eval_reward"] for r in evals],
            "o-",
            label="held-out reward (greedy)",
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (verifier)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("GRPO on the arithmetic task")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def preference_pairs(
    model: Transformer,
    tokenizer,
    records: list[dict],
    *,
    samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """On-policy preference pairs: `samples` answers of `model` to each problem, labelled by the
    verifier; a problem with a right and a wrong answer gives {"prompt", "chosen": right,
    "rejected": wrong}. Problems the model always (or never) solves give none."""
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in records
    ]
    completions = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=8,
        temperature=temperature,
        n=samples,
        seed=seed,
    )
    pairs = []
    for record, options in zip(records, completions, strict=True):
        texts = list(dict.fromkeys(c.text.strip() for c in options))
        right = [t for t in texts if integer_correct(t, record)]
        wrong = [t for t in texts if t and not integer_correct(t, record)]
        if right and wrong:
            pairs.append(
                {
                    "prompt": record["prompt"],
                    "chosen": right[0],
                    "rejected": wrong[0],
                    "domain": DOMAIN,
                }
            )
    return pairs


def _write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def run_demo(
    workdir: str = "runs/demo",
    *,
    overrides: dict | None = None,
    dpo_overrides: dict | None = None,
    rl_overrides: dict | None = None,
) -> dict:
    """Runs the demo's stages in `workdir` and prints a before/after table.

    Stage 1 (SFT) trains the tiny model from scratch; stage 2 (DPO) samples its answers to
    training problems, pairs right with wrong ones by the verifier, and trains on those pairs
    from the SFT checkpoint (configs/dpo.py:tiny); stage 3 (GRPO) starts from the SFT checkpoint
    too, with the verifier as the reward (configs/grpo.py:tiny), so the table compares the two.

    Args:
      workdir: output directory (checkpoints, metrics, pairs, loss curve).
      overrides: dotted keys of the SFT config to change, e.g. `{"train.steps": 50}`.
      dpo_overrides, rl_overrides: the same for the DPO and GRPO configs.

    Returns:
      `{"accuracy_before", "accuracy_after", "accuracy_dpo", "accuracy_rl",
      "preference_before", "preference_after", "eval_problems", "loss_curve", "reward_curve",
      ...}`.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    config_dict = override(load_config_file(f"{SFT_CONFIG}:tiny"), overrides)
    sft, config = method_config(config_dict)  # (the methods' records: posttrain.methods)
    tokenizer = load_tokenizer(config.tokenizer)
    held_out = _records(config.eval_data[0].path)

    console.print(
        f"[bold]posttrain demo[/bold] (JAX {jax.__version__} on "
        f"{jax.devices()[0].platform}, workdir {workdir})"
    )
    model_config = config.model.model_config()
    untrained = Transformer.init(model_config, rng=config.train.seed)
    before = float(greedy_exact_match(untrained, tokenizer, held_out).mean())
    console.print(
        f"stage 1 · SFT: {num_params(model_config) / 1e6:.2f}M-parameter model from "
        f"scratch, {config.train.steps} steps of {config.data.batch_size} rows"
    )
    start = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft")
    dpo_dir = os.path.join(workdir, "dpo")
    rl_dir = os.path.join(workdir, "grpo")
    for stale in (sft_dir, dpo_dir, rl_dir):  # a demo always starts from scratch (it would resume)
        if os.path.exists(stale):
            console.print(f"removing the previous demo run in {stale}")
            shutil.rmtree(stale)
    summary = sft.run(config, sft_dir)
    seconds = time.perf_counter() - start
    trained = Transformer(jax.device_get(summary["state"].params), summary["model_config"])
    after = float(greedy_exact_match(trained, tokenizer, held_out).mean())
    curve = plot_loss(sft_dir, os.path.join(workdir, "sft_loss.png"))

    # Stage 2: pairs of the SFT model's own right and wrong answers, labelled by the verifier.
    start = time.perf_counter()
    dpo_dict = override(load_config_file(f"{DPO_CONFIG}:tiny"), dpo_overrides)
    train_problems = _records(config.data.sources[0].path, _PAIR_PROBLEMS)
    files = {
        "train": _write_jsonl(
            os.path.join(workdir, "preferences_train.jsonl"),
            preference_pairs(trained, tokenizer, train_problems, seed=1),
        ),
        "eval": _write_jsonl(
            os.path.join(workdir, "preferences_eval.jsonl"),
            preference_pairs(trained, tokenizer, held_out, seed=2),
        ),
    }
    dpo_dict.model.checkpoint = sft_dir
    dpo_dict.data.sources = [{**dpo_dict.data.sources[0], "path": files["train"]}]
    dpo_dict.eval_data = [{**dpo_dict.eval_data[0], "path": files["eval"]}]
    dpo, dpo_config = method_config(dpo_dict)
    eval_pairs = _records(files["eval"])
    console.print(
        f"stage 2 · DPO: {sum(1 for _ in open(files['train']))} pairs of the SFT model's right "
        f"and wrong answers (from {len(train_problems)} problems x 4 samples), "
        f"{dpo_config.train.steps} steps of {dpo_config.data.batch_size} pairs"
    )
    preference_before = prefers_chosen(trained, tokenizer, eval_pairs)
    dpo_summary = dpo.run(dpo_config, dpo_dir)
    dpo_seconds = time.perf_counter() - start
    aligned = Transformer(jax.device_get(dpo_summary["state"].params), dpo_summary["model_config"])
    accuracy_dpo = float(greedy_exact_match(aligned, tokenizer, held_out).mean())
    preference_after = prefers_chosen(aligned, tokenizer, eval_pairs)

    # Stage 3: GRPO from the SFT checkpoint (stage 1), the verifier as the reward.
    start = time.perf_counter()
    rl_dict = override(load_config_file(f"{GRPO_CONFIG}:tiny"), rl_overrides)
    rl_dict.model.checkpoint = sft_dir
    grpo, rl_config = method_config(rl_dict)
    console.print(
        f"stage 3 · GRPO from the SFT model: {rl_config.train.steps} steps of "
        f"{rl_config.data.batch_size} training problems x {rl_config.rollout.num_generations} "
        "samples, reward = the verifier"
    )
    rl_summary = grpo.run(rl_config, rl_dir)
    rl_seconds = time.perf_counter() - start
    policy = Transformer(jax.device_get(rl_summary["state"].params), rl_summary["model_config"])
    accuracy_rl = float(greedy_exact_match(policy, tokenizer, held_out).mean())
    reward_curve = plot_rewards(rl_dir, os.path.join(workdir, "rl_reward.png"))

    table = Table(
        title=f"held-out problems ({len(held_out)}) and held-out pairs ({len(eval_pairs)})"
    )
    for column in ("stage", "exact match (greedy)", "prefers right answer", "train time"):
        table.add_column(column)
    table.add_row("untrained", f"{100 * before:.1f}%", "-", "-")
    table.add_row(
        "after SFT", f"{100 * after:.1f}%", f"{100 * preference_before:.1f}%", f"{seconds:.0f}s"
    )
    table.add_row(
        "SFT + DPO",
        f"{100 * accuracy_dpo:.1f}%",
        f"{100 * preference_after:.1f}%",
        f"{dpo_seconds:.0f}s",
    )
    table.add_row("SFT + GRPO", f"{100 * accuracy_rl:.1f}%", "-", f"{rl_seconds:.0f}s")
    console.print(table)
    console.print(
        "prefers right answer: held-out pairs (the SFT model's right and wrong answers to "
        "held-out problems) whose right answer the model finds likelier"
    )
    console.print(f"loss curve: {curve}; reward curve: {reward_curve}")
    result = {
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_dpo": accuracy_dpo,
        "accuracy_rl": accuracy_rl,
        "preference_before": preference_before,
        "preference_after": preference_after,
        "dpo_eval": dpo_summary.get("eval", {}),
        "eval_problems": len(held_out),
        "eval_pairs": len(eval_pairs),
        "sft_seconds": seconds,
        "dpo_seconds": dpo_seconds,
        "rl_seconds": rl_seconds,
        "rl_eval": rl_summary.get("eval", {}),
        "reward_curve": reward_curve,
        "loss_curve": curve,
        "sft_workdir": sft_dir,
        "dpo_workdir": dpo_dir,
        "rl_workdir": rl_dir,
    }
    with open(os.path.join(workdir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result
