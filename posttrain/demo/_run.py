"""`make demo`: supervised fine-tuning of a tiny model on the bundled arithmetic task, on CPU.

Stage 1 (SFT) trains the `tiny` transformer from scratch on two-digit addition and subtraction
chats and reports greedy exact-match accuracy on held-out problems before and after. Later
stages (DPO, RL) extend this file.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax

from posttrain.config import build, load_config_file
from posttrain.data import load_tokenizer
from posttrain.eval import greedy_exact_match
from posttrain.models import Transformer
from posttrain.train import SFTConfig, read_metrics, run_sft

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_CONFIG = os.path.join(_REPO, "configs", "sft.py")


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


def run_demo(workdir: str = "runs/demo", *, overrides: dict | None = None) -> dict:
    """Runs the demo's stages in `workdir` and prints a before/after table.

    Args:
      workdir: output directory (checkpoints, metrics, loss curve).
      overrides: dotted config keys to change, e.g. `{"train.steps": 50}` (tests).

    Returns:
      `{"accuracy_before", "accuracy_after", "eval_problems", "loss_curve", ...}`.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    config_dict = load_config_file(f"{SFT_CONFIG}:tiny")
    for key, value in (overrides or {}).items():
        node = config_dict
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    config = build(SFTConfig, {k: v for k, v in config_dict.items() if k != "method"})
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
        f"stage 1 · SFT: {model_config.num_params() / 1e6:.2f}M-parameter model from "
        f"scratch, {config.train.steps} steps of {config.data.batch_size} rows"
    )
    start = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft")
    if os.path.exists(sft_dir):  # a demo always starts from scratch (it would resume otherwise)
        console.print(f"removing the previous demo run in {sft_dir}")
        shutil.rmtree(sft_dir)
    summary = run_sft(config, sft_dir)
    seconds = time.perf_counter() - start
    trained = Transformer(jax.device_get(summary["state"].params), summary["model_config"])
    after = float(greedy_exact_match(trained, tokenizer, held_out).mean())
    curve = plot_loss(sft_dir, os.path.join(workdir, "sft_loss.png"))

    table = Table(title="held-out exact match (greedy)")
    for column in ("stage", "accuracy", "problems", "train time"):
        table.add_column(column)
    table.add_row("untrained", f"{100 * before:.1f}%", str(len(held_out)), "-")
    table.add_row("after SFT", f"{100 * after:.1f}%", str(len(held_out)), f"{seconds:.0f}s")
    console.print(table)
    console.print(f"loss curve: {curve}")
    result = {
        "accuracy_before": before,
        "accuracy_after": after,
        "eval_problems": len(held_out),
        "sft_seconds": seconds,
        "loss_curve": curve,
        "sft_workdir": sft_dir,
    }
    with open(os.path.join(workdir, "demo_results.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result
