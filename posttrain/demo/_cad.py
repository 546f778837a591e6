"""The CAD task set and demo: SFT data from the task generator's reference scripts, and a tiny
model that learns to write CAD scripts (SFT from scratch, then GRPO with the `cad` reward).

`build_cad_assets` writes what a run needs: a byte-level BPE tokenizer trained on CAD text (512
tokens, the `tiny` preset's vocabulary, ChatML with tool calls), `sft.jsonl` (chats whose answer
is a task's reference script), `trajectories.jsonl` (the same tasks as solved `cad` environment
episodes: a `build_part` call with the reference script, the measurements it answers with, the
final script) and the RL prompt files `train.jsonl` and `eval.jsonl` (held-out tasks whose
descriptions occur in no other file; SFT and RL tasks may share descriptions: level 1 has
3,960 distinct plates). Everything is reproducible from its arguments.

`run_cad_demo` trains the tiny model from scratch on `sft.jsonl` (`configs/cad.py:sft`; the
demo's chats leave `cad.show` out of half the scripts, `UNSHOWN`), then GRPO from it
(`configs/cad.py:grpo`), and reports the held-out mean CAD reward and its parts before and
after, sampled and greedy, with a grid of renders of the same held-out tasks before and after
GRPO (docs/cad.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from posttrain.demo._assets import build_tokenizer
from posttrain.demo._calculator import CALCULATOR_TEMPLATE
from posttrain.rewards._cad_tasks import cad_sft_record, make_cad_task

# The demo's SFT chats: half of their scripts leave out cad.show (see build_cad_assets), a
# flaw SFT imitates and GRPO, rewarded only for parts built, learns away.
UNSHOWN = 0.5
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cad.py")


def cad_trajectory(task: dict) -> dict:
    """A solved `cad` environment episode of `task` as an SFT record with `tools`: the
    reference script sent to `build_part`, the measurements the tool answers with, and the
    final script."""
    from posttrain.envs._cad import CAD_SYSTEM, cad_env, describe
    from posttrain.rewards._cad import build
    from posttrain.rewards._cad_geometry import measure

    call = {"name": "build_part", "arguments": {"script": task["reference"]}}
    tools = cad_env({"prompt": "", "domain": "cad"}).schemas  # (the tool as episodes see it)
    return {
        "messages": [
            {"role": "system", "content": CAD_SYSTEM},
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": describe(measure(build(task["target"])))},
            {"role": "assistant", "content": f"```python\n{task['reference']}```"},
        ],
        "tools": tools,
        "domain": "cad",
    }  # fmt: skip


def _prompt_record(task: dict) -> dict:
    """An RL prompt record: the description as a user turn and what the `cad` reward reads
    (not the reference script)."""
    keep = ("target", "holes", "level", "family", "domain")
    return {"prompt": [{"role": "user", "content": task["prompt"]}], **{k: task[k] for k in keep}}


def _unshown(task: dict) -> dict:
    """`task` with its reference script's final `cad.show(part)` line left out."""
    code = task["reference"]
    assert code.endswith("cad.show(part)\n"), code
    return {**task, "reference": code[: -len("cad.show(part)\n")]}


def make_cad_tasks(n: int, seed: int, levels: Sequence[int], *, exclude=()) -> list[dict]:
    """`n` tasks with distinct descriptions (none in `exclude`), levels in turn from `levels`,
    drawn from the seeds `seed`, `seed + 1`, ..."""
    seen = {t["prompt"] for t in exclude}
    out, i, misses = [], 0, 0
    while len(out) < n:
        if misses > 5000:  # (draws in a row that repeated a description: the levels ran dry)
            raise ValueError(f"fewer than {n} distinct CAD tasks at levels {list(levels)}")
        task = make_cad_task(seed + i, levels[i % len(levels)])
        i, misses = i + 1, misses + 1
        if task["prompt"] not in seen:
            seen.add(task["prompt"])
            out.append(task)
            misses = 0
    return out


def build_cad_tokenizer(out_dir: str | Path, texts: Sequence[str]) -> str:
    """The demo's byte-level BPE tokenizer (`VOCAB_SIZE` entries, digits single tokens, so
    numbers are spelled out) learnt on `texts`, with ChatML and tool calls
    (`CALCULATOR_TEMPLATE`); returns its directory."""
    return build_tokenizer(out_dir, texts=texts, chat_template=CALCULATOR_TEMPLATE)


# What `build_cad_assets` writes into its folder.
ASSET_FILES = ("tokenizer", "sft.jsonl", "trajectories.jsonl", "train.jsonl", "eval.jsonl")


def build_cad_assets(
    out_dir: str | Path,
    *,
    n_sft: int = 3000,
    n_train: int = 1000,
    n_eval: int = 64,
    levels: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    unshown: float = 0.0,
    progress: bool = False,
) -> dict[str, str]:
    """Writes `tokenizer/`, `sft.jsonl`, `trajectories.jsonl`, `train.jsonl` and `eval.jsonl`
    (see the module docstring) into `out_dir`; the same bytes for the same arguments. Held-out
    tasks are drawn first, so they stay the same when the other sizes change. `unshown`: the
    share of SFT chats whose script leaves out its final `cad.show(part)` (flawed data, as
    scripts written for other CAD APIs end in a bare part; such a script builds nothing).

    Returns:
      {"tokenizer", "sft", "trajectories", "train", "eval"}: the paths.
    """
    from tqdm import tqdm

    from posttrain.envs._cad import CAD_SYSTEM

    base = 10_000_000 * (seed + 1)
    held_out = make_cad_tasks(n_eval, base, levels)
    train = make_cad_tasks(n_train, base + 1_000_000, levels, exclude=held_out)
    sft = make_cad_tasks(n_sft, base + 3_000_000, levels, exclude=held_out)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flawed = random.Random(f"unshown-{seed}")
    rows = {
        "sft": [cad_sft_record(_unshown(t) if flawed.random() < unshown else t) for t in sft],
        "trajectories": [
            cad_trajectory(t) for t in tqdm(sft, "trajectories", disable=not progress)
        ],
        "train": [_prompt_record(t) for t in train],
        "eval": [_prompt_record(t) for t in held_out],
    }
    corpus = [CAD_SYSTEM, *["system", "user", "assistant", "tool"] * 500]
    corpus += [m["content"] for r in rows["trajectories"][:1000] for m in r["messages"]]
    paths = {"tokenizer": build_cad_tokenizer(out / "tokenizer", corpus)}
    for name, records in rows.items():
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths


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
    from posttrain.data._formats import encode_prompt
    from posttrain.rewards._cad import cad_reward
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
    return {"reward": float(np.mean([s["reward"] for s in scores])), **parts}


def cad_metrics(model, tokenizer, records) -> tuple[dict, list[dict]]:
    """Held-out mean reward and parts, sampled as in training (temperature 1, 8 scripts per
    task) and greedy: ({"sampled": means, "greedy": means}, greedy scores)."""
    sampled = cad_scores(model, tokenizer, records, temperature=1.0, samples=8)
    greedy = cad_scores(model, tokenizer, records)
    return {"sampled": _means(sampled), "greedy": _means(greedy)}, greedy


def run_cad_demo(
    workdir: str = "runs/cad",
    *,
    assets: dict | None = None,
    sft_overrides: dict | None = None,
    rl_overrides: dict | None = None,
    renders: int = 8,
) -> dict:
    """Builds the assets in `workdir/assets` (unless `assets` are given), SFT from scratch
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

    from posttrain.config import build, load_config_file, override
    from posttrain.data import load_tokenizer
    from posttrain.models import Transformer
    from posttrain.rl import RLConfig, run_rl
    from posttrain.train import SFTConfig, run_sft

    console = Console()
    for stale in ("sft", "grpo"):  # a demo starts from scratch (a workdir would resume)
        shutil.rmtree(os.path.join(workdir, stale), ignore_errors=True)
    assets = assets or build_cad_assets(os.path.join(workdir, "assets"), unshown=UNSHOWN)
    tokenizer = load_tokenizer(assets["tokenizer"])
    held_out = [json.loads(line) for line in open(assets["eval"])]

    def source(path):
        return {"path": path, "weight": 1.0, "domain": "cad", "format": "auto"}

    sft_dir, rl_dir = os.path.join(workdir, "sft"), os.path.join(workdir, "grpo")
    values = {"tokenizer": assets["tokenizer"], "data.sources": [source(assets["sft"])]}
    sft_dict = override(load_config_file(f"{CONFIG}:sft"), {**values, **(sft_overrides or {})})
    sft = build(SFTConfig, {k: v for k, v in sft_dict.items() if k != "method"})
    console.print(f"stage 1 · SFT from scratch: {sft.train.steps} steps on reference scripts")
    start = time.perf_counter()
    summary = run_sft(sft, sft_dir)
    seconds = {"sft": time.perf_counter() - start}
    model = Transformer(jax.device_get(summary["state"].params), summary["model_config"])
    result = {"eval_tasks": len(held_out)}
    result["sft"], before = cad_metrics(jax.device_put(model), tokenizer, held_out)

    rl_values = {
        "model.checkpoint": sft_dir,
        "tokenizer": assets["tokenizer"],
        "data.sources": [source(assets["train"])],
        "eval_data": [source(assets["eval"])],
        **(rl_overrides or {}),
    }
    rl_dict = override(load_config_file(f"{CONFIG}:grpo"), rl_values)
    rl = build(RLConfig, {k: v for k, v in rl_dict.items() if k != "method"})
    console.print(
        f"stage 2 · GRPO with the cad reward: {rl.train.steps} steps of {rl.data.batch_size} "
        f"tasks x {rl.rollout.num_generations} scripts"
    )
    start = time.perf_counter()
    rl_summary = run_rl(rl, rl_dir)
    seconds["rl"] = time.perf_counter() - start
    policy = Transformer(jax.device_get(rl_summary["state"].params), rl_summary["model_config"])
    result["rl"], after = cad_metrics(jax.device_put(policy), tokenizer, held_out)

    table = Table(title=f"held-out CAD tasks ({len(held_out)}): mean reward and its parts")
    names = list(result["sft"]["sampled"])
    for column in ("stage", "decoding", *names, "train time"):
        table.add_column(column)
    for stage, label in (("sft", "after SFT"), ("rl", "SFT + GRPO")):
        for decoding in ("sampled", "greedy"):
            values = result[stage][decoding]
            time_cell = f"{seconds[stage]:.0f} s" if decoding == "sampled" else ""
            table.add_row(label, decoding, *(f"{values[k]:.3f}" for k in names), time_cell)
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
    from posttrain.rewards._cad import build, completion_part
    from posttrain.rewards._cad_render import render_grid

    cells = []
    for i, (r, b, a) in enumerate(zip(records, before, after, strict=True)):
        cells += [
            (f"task {i} · target", build(r["target"])),
            (f"after SFT · {b['reward']:.2f}", completion_part(b["text"]).solid),
            (f"after GRPO · {a['reward']:.2f}", completion_part(a["text"]).solid),
        ]
    return render_grid(cells, path, columns=3)
