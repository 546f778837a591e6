"""GRPO side by side: posttrain vs TRL's GRPOTrainer vs Tunix's GRPOLearner, same work, one run.

The same tiny Llama (random init by transformers, saved once as an HF directory with the demo's
tokenizer), the same prompts (the demo's arithmetic questions, chat template applied), the same
group size, completion budget, temperature, reward function (benchmarks/_rl_task.py) and
optimizer (AdamW, constant rate), one optimizer update per RL step on all its completions. Each
implementation runs in its own process under its own environment (their pins are not ours):

    python3 -m venv /work/peers/trl-venv && /work/peers/trl-venv/bin/pip install torch==2.13.0 trl
    python3 -m venv /work/peers/tunix-venv && /work/peers/tunix-venv/bin/pip install google-tunix
    .venv/bin/python benchmarks/rl_vs_peers.py --trl-python=/work/peers/trl-venv/bin/python \\
        --tunix-python=/work/peers/tunix-venv/bin/python

Each reports the mean RL step time over the steps after `--warmup` (those compile), split into
generation / reward / train as each implementation's own phases allow, sampled tokens per
second, and its per-step mean reward. Results: benchmarks/results/rl_vs_peers_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _machine import cpu_model, vector_extensions  # benchmarks/ is the script directory

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULT = os.path.join(HERE, "results", "rl_vs_peers_cpu.json")
WORKERS = {
    "posttrain": "_grpo_posttrain.py",
    "trl": "_grpo_trl.py",
    "tunix": "_grpo_tunix.py",
}
# The model: generate_throughput.py's Llama (4 layers, d=256, 8 q / 4 kv heads, MLP 1024) with
# the demo tokenizer's 512 ids and RoPE theta 1e6 (Tunix's Llama3 rotates with 1e6 whatever its
# config says: benchmarks/tunix_sampler.py).


def prepare(folder: str, args) -> str:
    """Writes the model, tokenizer and spec.json into `folder`; returns the spec's path."""
    import torch
    import transformers
    from generate_throughput import HF_CONFIG

    from posttrain.demo import ASSETS_DIR

    model_dir = os.path.join(folder, "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ASSETS_DIR / "tokenizer"))
    config = transformers.LlamaConfig(
        **{**HF_CONFIG, "vocab_size": len(tokenizer), "rope_theta": 1e6},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(ASSETS_DIR / "train.jsonl") as f:
        records = [json.loads(line) for line in f]
    prompts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in records[: args.prompts_per_step * args.steps]
    ]
    spec = {
        "model_dir": model_dir,
        "prompts": prompts,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": max(len(tokenizer(p).input_ids) for p in prompts),
        "temperature": 1.0,
        "learning_rate": args.learning_rate,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": 0,
        "threads": os.cpu_count(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    path = os.path.join(folder, "spec.json")
    with open(path, "w") as f:
        json.dump(spec, f, indent=2)
    return path


# posttrain's levers, each row adding one to the row before (`--levers`): the settings that
# undo the later ones, then the defaults, then decoupled rollouts on a second CPU device.
LEVERS = {
    "posttrain, before the levers": (
        {"rollout.sampling.top_k": 512, "algorithm.fuse_old_logps": False}, 1),
    "+ sampling without a vocabulary sort": ({"algorithm.fuse_old_logps": False}, 1),
    "+ old log-probs from the update's forward (defaults)": ({}, 1),
    "+ decoupled rollouts (2 CPU devices, staleness 1)": (
        {"rollout.sampler_devices": 1, "rollout.max_staleness": 1}, 2),
}  # fmt: skip


def run_worker(name: str, python: str, spec: str, folder: str, extra=()) -> dict:
    out = os.path.join(folder, f"{name}.json")
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + REPO}
    start = time.perf_counter()
    script = os.path.join(HERE, WORKERS[name.split(":")[0]])
    subprocess.run([python, script, "--spec", spec, "--out", out, *extra], check=True, env=env)
    with open(out) as f:
        result = json.load(f)
    result["process_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trl-python", default="", help="a Python with trl and torch")
    parser.add_argument("--tunix-python", default="", help="a Python with google-tunix")
    parser.add_argument("--only", default="", help="comma-separated subset of " + ",".join(WORKERS))
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prepare", default="", help="only write the task into this folder")
    parser.add_argument("--levers", action="store_true", help="posttrain with each lever added")
    parser.add_argument("--out", default=RESULT)
    args = parser.parse_args()
    if args.prepare:
        print(prepare(args.prepare, args))
        return
    pythons = {"posttrain": sys.executable, "trl": args.trl_python, "tunix": args.tunix_python}
    chosen = args.only.split(",") if args.only else [k for k, v in pythons.items() if v]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        spec = prepare(folder, args)
        for name in chosen:
            print(f"--- {name}", flush=True)
            results[name] = run_worker(name, pythons[name], spec, folder)
        for i, (label, (settings, devices)) in enumerate(LEVERS.items() if args.levers else ()):
            print(f"--- {label}", flush=True)
            extra = ("--set", json.dumps(settings), "--devices", str(devices))
            results[label] = run_worker(f"posttrain:{i}", sys.executable, spec, folder, extra)
        with open(spec) as f:
            task = {k: v for k, v in json.load(f).items() if k not in ("prompts", "model_dir")}
    report = {"task": task, "cpu": cpu_model(), "vector_extensions": vector_extensions(),
              "date": time.strftime("%Y-%m-%d"), "results": results}  # fmt: skip
    _print_table(report)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


def _print_table(report: dict) -> None:
    results = report["results"]
    peers = [r["step_s"] for k, r in results.items() if k in ("trl", "tunix")]
    best_peer = min(peers) if peers else None
    print(f"\n{report['cpu']}, {report['vector_extensions']}")
    print("| implementation | steps/s | step s | generate s | reward s | train s "
          "| sampled tokens/s | vs fastest peer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{best_peer / r['step_s']:.2f}x" if best_peer else ""
        label = f"{name} ({r['version']})" if name in WORKERS else name
        print(f"| {label} | {1 / r['step_s']:.2f} | {r['step_s']:.3f} | "
              f"{r['generate_s']:.3f} | {r['reward_s']:.3f} | {r['train_s']:.3f} | "
              f"{r['completion_tokens'] / r['step_s']:,.0f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()
