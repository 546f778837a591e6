"""CAD task files (`posttrain data cad`, docs/cad.md): RL prompts, disjoint held-out prompts,
SFT chats and tool-call trajectories from the task generator's reference scripts, and a
tokenizer for a model trained from scratch.

`build_cad_assets` writes a byte-level BPE tokenizer trained on CAD text (`VOCAB_SIZE` tokens,
the `tiny` preset's vocabulary, ChatML with tool calls), `sft.jsonl` (chats whose answer is a
task's reference script), `trajectories.jsonl` (the same tasks as solved `cad` environment
episodes: a `build_part` call with the reference script, the measurements it answers with, the
final script) and the RL prompt files `train.jsonl` and `eval.jsonl` (held-out tasks whose
descriptions occur in no other file; SFT and RL tasks may share descriptions: level 1 has
3,960 distinct plates). Everything is reproducible from its arguments.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from posttrain.curate._bpe import TOOL_CHAT_TEMPLATE, train_tokenizer
from posttrain.rewards import cad_sft_record, make_cad_task

# What `build_cad_assets` writes into its folder.
ASSET_FILES = ("tokenizer", "sft.jsonl", "trajectories.jsonl", "train.jsonl", "eval.jsonl")


def cad_trajectory(task: dict) -> dict:
    """A solved `cad` environment episode of `task` as an SFT record with `tools`: the
    reference script sent to `build_part`, the measurements the tool answers with, and the
    final script."""
    from posttrain.envs import CAD_SYSTEM, cad_env, describe_measurements
    from posttrain.rewards import build_solid, measure_solid

    call = {"name": "build_part", "arguments": {"script": task["reference"]}}
    tools = cad_env({"prompt": "", "domain": "cad"}).schemas  # (the tool as episodes see it)
    answer = describe_measurements(measure_solid(build_solid(task["target"])))
    return {
        "messages": [
            {"role": "system", "content": CAD_SYSTEM},
            {"role": "user", "content": task["prompt"]},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"```python\n{task['reference']}```"},
        ],
        "tools": tools,
        "domain": "cad",
    }  # fmt: skip


def _prompt_record(task: dict, aggregate: str) -> dict:
    """An RL prompt record: the description as a user turn and what the `cad` reward reads
    (not the reference script), its total made by `aggregate` ("gated" or "mean")."""
    keep = ("target", "holes", "features", "level", "family", "domain")
    record = {k: task[k] for k in keep}
    return {"prompt": [{"role": "user", "content": task["prompt"]}], **record,
            "aggregate": aggregate}  # fmt: skip


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
    """The byte-level BPE tokenizer (`VOCAB_SIZE` entries, digits single tokens, so numbers
    are spelled out) learnt on `texts`, with ChatML and tool calls (`TOOL_CHAT_TEMPLATE`);
    returns its directory."""
    return train_tokenizer(out_dir, texts, chat_template=TOOL_CHAT_TEMPLATE)


def build_cad_assets(
    out_dir: str | Path,
    *,
    n_sft: int = 3000,
    n_train: int = 1000,
    n_eval: int = 64,
    levels: Sequence[int] = (1, 2, 3),
    seed: int = 0,
    unshown: float = 0.0,
    aggregate: str = "gated",
    progress: bool = False,
) -> dict[str, str]:
    """Writes `tokenizer/`, `sft.jsonl`, `trajectories.jsonl`, `train.jsonl` and `eval.jsonl`
    (see the module docstring) into `out_dir`; the same bytes for the same arguments. Held-out
    tasks are drawn first, so they stay the same when the other sizes change. `unshown`: the
    share of SFT chats whose script leaves out its final `cad.show(part)` (flawed data, as
    scripts written for other CAD APIs end in a bare part; such a script builds nothing).
    `aggregate`: how the prompt records' reward makes its total from its components ("gated":
    a missing required feature caps it; "mean": the weighted mean; docs/cad.md).

    Returns:
      {"tokenizer", "sft", "trajectories", "train", "eval"}: the paths.
    """
    from tqdm import tqdm

    from posttrain.envs import CAD_SYSTEM
    from posttrain.rewards import CAD_AGGREGATES

    if aggregate not in CAD_AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r}: use one of {CAD_AGGREGATES}")
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
        "train": [_prompt_record(t, aggregate) for t in train],
        "eval": [_prompt_record(t, aggregate) for t in held_out],
    }
    corpus = [CAD_SYSTEM, *["system", "user", "assistant", "tool"] * 500]
    corpus += [m["content"] for r in rows["trajectories"][:1000] for m in r["messages"]]
    paths = {"tokenizer": build_cad_tokenizer(out / "tokenizer", corpus)}
    for name, records in rows.items():
        paths[name] = str(out / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in records))
    return paths
