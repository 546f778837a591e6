"""SFT training throughput: posttrain vs HF transformers + PyTorch eager, same model, same run.

Both sides take full optimizer steps (AdamW, next-token loss over every token) on the same
Llama-style model (4 layers, d=256, V=4096, float32) and the same batch of random token rows.

    python benchmarks/sft_throughput.py --batch=8 --seq=512 --steps=10

Reported in docs/benchmarks.md; the target is posttrain >= 1.5x PyTorch eager on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import numpy as np
from _peers import hf_llama  # benchmarks/ is the script directory

from posttrain.models import ModelConfig, init_params, num_params
from posttrain.train import OptimizerConfig, create_state, make_optimizer, sft_loss, train_step

MODEL = ModelConfig(
    vocab_size=4096,
    embed_dim=256,
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=32,
    mlp_dim=1024,
    attention="xla",
    remat="dots_no_batch",  # also the fastest choice on CPU: no stacked per-layer residuals
    name="bench-4L-256d",
)
LEARNING_RATE = 1e-4


def _batch(rows: int, seq: int) -> dict:
    tokens = np.random.RandomState(0).randint(0, MODEL.vocab_size, (rows, seq + 1))
    return {
        "tokens": tokens[:, :-1].astype(np.int32),
        "targets": tokens[:, 1:].astype(np.int32),
        "loss_mask": np.ones((rows, seq), np.float32),
        "positions": np.tile(np.arange(seq, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones((rows, seq), np.int32),
    }


def time_posttrain(batch: dict, steps: int) -> float:
    optimizer = make_optimizer(OptimizerConfig(learning_rate=LEARNING_RATE, grad_clip=0.0), 100)
    state = create_state(init_params(MODEL, jax.random.key(0)), optimizer, seed=0)
    step = jax.jit(
        functools.partial(train_step, loss_fn=sft_loss(MODEL, 0.0), optimizer=optimizer),
        donate_argnums=0,
    )
    batch = jax.device_put(batch)
    for _ in range(2):  # compile, warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def time_pytorch(batch: dict, steps: int) -> float:
    import torch

    model = hf_llama(MODEL, "float32", "cpu")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0
    )
    tokens = torch.tensor(batch["tokens"], dtype=torch.long)
    targets = torch.tensor(batch["targets"], dtype=torch.long)

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import torch

    batch = _batch(args.batch, args.seq)
    tokens = args.batch * args.seq
    rows = {
        f"HF transformers + PyTorch eager ({torch.get_num_threads()} threads)": time_pytorch(
            batch, args.steps
        ),
        "posttrain (jit, XLA)": time_posttrain(batch, args.steps),
    }
    baseline = next(iter(rows.values()))
    print(
        f"\n{MODEL.name}: {num_params(MODEL) / 1e6:.1f}M params, batch {args.batch} x "
        f"{args.seq}, AdamW step, float32, {jax.devices()[0].device_kind} "
        f"({os.cpu_count()} cores)\n"
    )
    print("| implementation | step (ms) | tokens/s | speed vs PyTorch |")
    print("|---|---|---|---|")
    for name, seconds in rows.items():
        print(
            f"| {name} | {seconds * 1e3:.0f} | {tokens / seconds:,.0f} | "
            f"{baseline / seconds:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "seconds_per_step": rows}, f, indent=2)


if __name__ == "__main__":
    main()
