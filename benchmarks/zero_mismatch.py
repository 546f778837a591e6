"""The cost of the zero-mismatch mode (`model.batch_invariant`): one GRPO step's device work
with and without it, side by side in one run, on a small bfloat16 model on CPU.

    python benchmarks/zero_mismatch.py                 # dense, ~2 min on 2 cores
    python benchmarks/zero_mismatch.py --moe           # 8 experts, top-2

Per mode: sampling (`prompts` x `n` completions of `new` tokens on the paged engine, prompts
of `prompt_len` tokens), the trainer's log-prob pass over those rows (the old policy) and one
gradient of the policy-gradient surrogate over them (what an update costs); best of `reps`
after a compiling run. Prints each phase's seconds, the ratio mode / default, the per-token
gap between the sampler's and the trainer's log-probs, the command and the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _machine import cpu_model  # benchmarks/ is the script directory

from posttrain.models import MoEConfig, Transformer, get_preset, num_params
from posttrain.rl import rollout_batch, sequence_log_probs
from posttrain.sampling import Engine, EngineConfig, generate_continuous

SIZE = dict(  # small, but every matmul and attention block is more than a toy's
    vocab_size=4096, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
    mlp_dim=1024, max_seq_len=1024, compute_dtype="bfloat16",
)  # fmt: skip


def _phases(config, params, prompts, args):
    """(seconds per phase, best of `args.reps`; per-token |trainer - sampler| log-prob gaps)."""
    model = Transformer(params, config)
    max_len = args.prompt_len + args.new
    engine = Engine(model, EngineConfig(slots=len(prompts) * args.n), max_len=max_len)
    logp_fn = jax.jit(lambda p, b: sequence_log_probs(p, config, b))

    def surrogate(p, b):  # the policy-gradient term's shape: sum of advantage * log-prob
        logp = sequence_log_probs(p, config, b)
        return jnp.sum(logp * b["loss_mask"] * b["rewards"][:, None]) / jnp.sum(b["loss_mask"])

    grad_fn = jax.jit(jax.grad(surrogate))
    times = {"sample_s": [], "logprob_s": [], "grad_s": []}
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        groups = generate_continuous(
            model, None, prompts, max_new_tokens=args.new, n=args.n, temperature=1.0,
            seed=rep, engine=engine, eos_ids=[],
        )  # fmt: skip
        t1 = time.perf_counter()
        records = [{"prompt_ids": p, "domain_id": 0} for p in prompts]
        rewards = np.random.default_rng(rep).normal(size=(len(prompts), args.n))
        batch = rollout_batch(records, groups, rewards, groups=len(prompts), max_len=max_len)
        device_batch = {k: jnp.asarray(v) for k, v in batch.items()}
        t2 = time.perf_counter()
        logp = np.asarray(logp_fn(params, device_batch))
        t3 = time.perf_counter()
        jax.block_until_ready(grad_fn(params, device_batch))
        t4 = time.perf_counter()
        if rep:  # the first run compiles
            for k, dt in zip(times, (t1 - t0, t3 - t2, t4 - t3), strict=True):
                times[k].append(dt)
    mask = batch["loss_mask"] > 0
    gap = np.abs(logp - batch["sampler_logps"])[mask]
    return {k: min(v) for k, v in times.items()}, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--new", type=int, default=64, help="tokens per completion")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--moe", action="store_true", help="8 experts of width 256, top-2")
    parser.add_argument("--out", default="", help="also write the results here (JSON)")
    args = parser.parse_args()
    size = dict(SIZE)
    if args.moe:
        size["moe"] = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=256)
    default = get_preset("tiny", **size)
    params = Transformer.init(default, 0).params
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, default.vocab_size, args.prompt_len).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    results = {}
    modes = {"default": default, "zero_mismatch": default.replace(batch_invariant=True)}
    for name, config in modes.items():
        times, gap = _phases(config, params, prompts, args)
        times["total_s"] = sum(times.values())
        results[name] = {**times, "gap_mean": float(gap.mean()), "gap_max": float(gap.max())}
    command = "python " + " ".join(sys.argv)
    moe = " (MoE)" if args.moe else ""
    print(f"{command}\n{cpu_model()}, jax {jax.__version__}, "
          f"{num_params(default) / 1e6:.1f}M params{moe}, bfloat16, {args.prompts}x{args.n} "
          f"completions of {args.new} tokens after {args.prompt_len}")  # fmt: skip
    print(f"{'phase':<12}{'default':>10}{'zero-mismatch':>15}{'ratio':>8}")
    for k in ("sample_s", "logprob_s", "grad_s", "total_s"):
        a, b = results["default"][k], results["zero_mismatch"][k]
        print(f"{k:<12}{a:>10.3f}{b:>15.3f}{b / a:>8.2f}")
    for name, r in results.items():
        print(f"{name}: log-prob gap mean {r['gap_mean']:.3g}, max {r['gap_max']:.3g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "cpu": cpu_model(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
