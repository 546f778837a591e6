"""The CAD demo: a tiny model that learns to write CAD scripts (SFT from scratch, then GRPO with
the `cad` reward), on the task files of `posttrain.curate.build_cad_assets`.

`run_cad_demo` trains the tiny model from scratch on `sft.jsonl` (`configs/cad.py:sft`; the
demo's chats leave `cad.show` out of half the scripts, `UNSHOWN`), then GRPO from it
(`configs/cad.py:grpo`), and reports the held-out mean CAD reward and its parts before and
after, sampled and greedy, with a grid of renders of the same held-out tasks before and after
GRPO (docs/cad.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from posttrain.curate import build_cad_assets

# The demo's SFT chats: half of their scripts leave out cad.show (see build_cad_assets), a
# flaw SFT imitates and GRPO, rewarded only for parts built, learns away.
UNSHOWN = 0.5
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cad.py")


def cad_scores(
    model,
    tokenizer,
    records,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.0,
    samples: int = 1,
    seed: int = 0,
) -> list[dict]:
    """Completions of `records` (greedy by default; `samples` per record at `temperature`,
    record-major) scored by the `cad` reward: per completion
    {"text", "reward", "components", "error"}."""
    from posttrain.data import encode_prompt
    from posttrain.rewards import cad_reward
    from posttrain.sampling import generate

    prompt_ids = [encode_prompt(r, tokenizer) for r in records]
    completions = generate(
        model,
        tokenizer,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        n=samples,
        seed=seed,
    )
    out = []
    for r, group in zip(records, completions, strict=True):
        for c in group:
            reward, info = cad_reward(r, c.text)
            out.append({"text": c.text, "reward": reward, **info})
    return out


def _means(scores) -> dict:
    import numpy as np

    names = scores[0]["components"]
    parts = {k: float(np.mean([s["components"][k] for s in scores])) for k in names}
    built = [s for s in scores if not s["error"]]
    lacking = sum(bool(s.get("missing")) for s in built)  # built parts without a required feature
    return {"reward": float(np.mean([s["reward"] for s in scores])), **parts,
            "built": len(built), "built_missing_a_feature": lacking}  # fmt: skip


def cad_metrics(model, tokenizer, records, max_new_tokens: int) -> tuple[dict, list[dict]]:
    """Held-out mean reward and parts, sampled as in training (temperature 1, 8 scripts per
    task) and greedy, up to `max_new_tokens` each: ({"sampled": means, "greedy": means},
    greedy scores)."""
    sampled = cad_scores(
        model, tokenizer, records, max_new_tokens=max_new_tokens, temperature=1.0, samples=8
    )
    greedy = cad_scores(model, tokenizer, records, max_new_tokens=max_new_tokens)
    return {"sampled": _means(sampled), "greedy": _means(greedy)}, greedy


def run_cad_demo(
    workdir: str = "runs/cad",
    *,
    assets: dict | None = None,
    sft_overrides: dict | None = None,
    rl_overrides: dict | None = None,
    renders: int = 8,
    aggregate: str = "gated",
) -> dict:
    """Builds the assets in `workdir/assets` (unless `assets` are given; `aggregate`: their
    RL prompts' reward total, "mean" or "gated", docs/cad.md), SFT from scratch
    (`configs/cad.py:sft`), GRPO from it (`configs/cad.py:grpo`); prints the held-out mean
    CAD reward and its parts after each stage and writes `workdir/renders.png`: the first
    `renders` held-out tasks' parts, target / after SFT / after GRPO.

    Returns:
      {"sft": {"sampled": {"reward", <component means>}, "greedy": {...}}, "rl": {...},
       "eval_tasks", "renders"}.
    """
    import jax
    from rich.console import Console
    from rich.table import Table

    from posttrain.config import load_config_file, override
    from posttrain.data import load_tokenizer
    from posttrain.methods import method_config
    from posttrain.models import Transformer

    console = Console()
    if not console.is_terminal:  # a log: its 13 columns at full width, not cut to 80 characters
        console = Console(width=160)
    for stale in ("sft", "grpo"):  # a demo starts from scratch (a workdir would resume)
        shutil.rmtree(os.path.join(workdir, stale), ignore_errors=True)
    assets = assets or build_cad_assets(
        os.path.join(workdir, "assets"), unshown=UNSHOWN, aggregate=aggregate
    )
    tokenizer = load_tokenizer(assets["tokenizer"])
    held_out = [json.loads(line) for line in open(assets["eval"])]

    def source(path):
        return {"path": path, "weight": 1.0, "domain": "cad", "format": "auto"}

    sft_dir, rl_dir = os.path.join(workdir, "sft"), os.path.join(workdir, "grpo")
    values = {"tokenizer": assets["tokenizer"], "data.sources": [source(assets["sft"])]}
    sft_dict = override(load_config_file(f"{CONFIG}:sft"), {**values, **(sft_overrides or {})})
    sft_method, sft = method_config(sft_dict)  # (the methods' records: posttrain.methods)
    rl_values = {
        "model.checkpoint": sft_dir,
        "tokenizer": assets["tokenizer"],
        "data.sources": [source(assets["train"])],
        "eval_data": [source(assets["eval"])],
        **(rl_overrides or {}),
    }
    rl_dict = override(load_config_file(f"{CONFIG}:grpo"), rl_values)
    rl_method, rl = method_config(rl_dict)
    console.print(f"stage 1 · SFT from scratch: {sft.train.steps} steps on reference scripts")
    start = time.perf_counter()
    summary = sft_method.run(sft, sft_dir)
    seconds = {"sft": time.perf_counter() - start}
    model = Transformer(jax.device_get(summary["state"].params), summary["model_config"])
    result = {"eval_tasks": len(held_out)}
    length = rl.rollout.max_new_tokens  # held-out scripts as long as GRPO's
    result["sft"], before = cad_metrics(jax.device_put(model), tokenizer, held_out, length)

    console.print(
        f"stage 2 · GRPO with the cad reward: {rl.train.steps} steps of {rl.data.batch_size} "
        f"tasks x {rl.rollout.num_generations} scripts"
    )
    start = time.perf_counter()
    rl_summary = rl_method.run(rl, rl_dir)
    seconds["rl"] = time.perf_counter() - start
    policy = Transformer(jax.device_get(rl_summary["state"].params), rl_summary["model_config"])
    result["rl"], after = cad_metrics(jax.device_put(policy), tokenizer, held_out, length)

    table = Table(title=f"held-out CAD tasks ({len(held_out)}): mean reward and its parts")
    names = list(result["sft"]["sampled"])
    for column in ("stage", "decoding", *names, "train time"):
        table.add_column(column)
    for stage, label in (("sft", "after SFT"), ("rl", "SFT + GRPO")):
        for decoding in ("sampled", "greedy"):
            values = result[stage][decoding]
            time_cell = f"{seconds[stage]:.0f} s" if decoding == "sampled" else ""
            cells = (f"{v:.3f}" if isinstance(v, float) else str(v) for v in map(values.get, names))
            table.add_row(label, decoding, *cells, time_cell)
    console.print(table)
    console.print("sampled: 8 scripts per task at temperature 1, as in training")
    if renders:
        result["renders"] = render_before_after(
            held_out[:renders],
            before[:renders],
            after[:renders],
            os.path.join(workdir, "renders.png"),
        )
        console.print(f"renders (greedy scripts): {result['renders']}")
    return result


def render_before_after(records, before, after, path: str) -> str:
    """A grid of renders, a row per task: its target, the part after SFT, after GRPO."""
    from posttrain.rewards import build_solid, completion_part, render_grid

    cells = []
    for i, (r, b, a) in enumerate(zip(records, before, after, strict=True)):
        cells += [
            (f"task {i} · target", build_solid(r["target"])),
            (f"after SFT · {b['reward']:.2f}", completion_part(b["text"]).solid),
            (f"after GRPO · {a['reward']:.2f}", completion_part(a["text"]).solid),
        ]
    return render_grid(cells, path, columns=3)
