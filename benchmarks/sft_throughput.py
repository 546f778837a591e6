"""SFT training throughput: posttrain vs HF transformers (PyTorch eager and `torch.compile`) and
Tunix's `PeftTrainer`, same model, same run.

Every side takes full optimizer steps (AdamW, next-token loss over every token) on the same
Llama-style model (4 layers, d=256, V=4096, float32) and the same batch of random token rows.
Tunix runs in its own venv (benchmarks/_sft_tunix.py, re-invoked with `--tunix-python`):

    python benchmarks/sft_throughput.py --batch=8 --seq=512 --steps=10 \
        --tunix-python=/work/peers/tunix-venv/bin/python

It also times each matrix multiply of posttrain's step alone (its shapes from the step's
jaxpr, each at its best of 5, in XLA and in PyTorch) and reports the step against the sum of
the faster of the two per shape: the machine's matmul roofline for this step.
Reported in docs/benchmarks.md; the target is posttrain's step at >= 85% of that roofline and
faster than `torch.compile`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _machine import cpu_model, vector_extensions  # benchmarks/ is the script directory
from _peers import hf_llama
from jax.extend.core import jaxprs_in_params

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


def _posttrain_step():
    """(posttrain's SFT step, not jitted; its initial train state)."""
    optimizer = make_optimizer(OptimizerConfig(learning_rate=LEARNING_RATE, grad_clip=0.0), 100)
    state = create_state(init_params(MODEL, jax.random.key(0)), optimizer, seed=0)
    return functools.partial(train_step, loss_fn=sft_loss(MODEL, 0.0), optimizer=optimizer), state


def time_posttrain(batch: dict, steps: int) -> float:
    step, state = _posttrain_step()
    step = jax.jit(step, donate_argnums=0)
    batch = jax.device_put(batch)
    for _ in range(2):  # compile, warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps


def _step_matmuls(jaxpr, times: int = 1, out=None) -> dict:
    """{(lhs shape, rhs shape, dimension numbers, dtype): runs per step} of every
    `dot_general` the step executes: scan bodies `length` times, rematerialised forwards
    again where the backward recomputes them (they appear again in the jaxpr)."""
    out = {} if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            a, b = eqn.invars[0].aval, eqn.invars[1].aval
            key = (a.shape, b.shape, eqn.params["dimension_numbers"], str(a.dtype))
            out[key] = out.get(key, 0) + times
            continue
        trips = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for sub in jaxprs_in_params(eqn.params):
            _step_matmuls(getattr(sub, "jaxpr", sub), times * trips, out)
    return out


def _matmul_seconds(key, reps: int = 5) -> float:
    """Best time of one such matmul alone: 16 chained in a jitted scan, so that dispatch is
    amortised and each reads its operands from memory as the step would."""
    a_shape, b_shape, numbers, dtype = key
    a, b = jnp.ones(a_shape, dtype), jnp.ones(b_shape, dtype)

    @jax.jit
    def chain(a, b):
        def body(carry, _):
            out = jax.lax.dot_general(a + carry, b, numbers)
            return carry + out.ravel()[0] * 0, None

        return jax.lax.scan(body, jnp.zeros((), dtype), length=16)[0]

    chain(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        chain(a, b).block_until_ready()
        best = min(best, (time.perf_counter() - start) / 16)
    return best


def _torch_matmul_seconds(key, reps: int = 5) -> float:
    """The same matmul's best time in PyTorch (its own GEMM library), as an einsum."""
    import torch

    a_shape, b_shape, ((lc, rc), (lb, rb)), dtype = key
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    a_sub = [next(letters) for _ in a_shape]
    b_sub = [next(letters) for _ in b_shape]
    for i, j in zip((*lc, *lb), (*rc, *rb), strict=True):
        b_sub[j] = a_sub[i]
    free_a = [a_sub[i] for i in range(len(a_shape)) if i not in (*lc, *lb)]
    free_b = [b_sub[j] for j in range(len(b_shape)) if j not in (*rc, *rb)]
    spec = f"{''.join(a_sub)},{''.join(b_sub)}->{''.join([a_sub[i] for i in lb] + free_a + free_b)}"
    a = torch.ones(a_shape, dtype=getattr(torch, dtype))
    b = torch.ones(b_shape, dtype=getattr(torch, dtype))
    torch.einsum(spec, a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(16):
            torch.einsum(spec, a, b)
        best = min(best, (time.perf_counter() - start) / 16)
    return best


def matmul_roofline(batch: dict) -> tuple[float, float, float]:
    """(seconds with XLA's kernels, seconds with the faster of XLA's and PyTorch's per shape,
    FLOPs) of the posttrain step's matmuls, each shape timed alone at its best: the step's
    time if everything but its matmuls were free."""
    step, state = _posttrain_step()
    matmuls = _step_matmuls(jax.make_jaxpr(step)(state, batch).jaxpr)
    xla = best = flops = 0.0
    for key, count in matmuls.items():
        a_shape, b_shape, ((lc, _), (lb, _)), _ = key
        contract = math.prod(a_shape[i] for i in lc)
        batch_size = math.prod(a_shape[i] for i in lb)
        flops += count * 2.0 * math.prod(a_shape) * math.prod(b_shape) / (contract * batch_size)
        alone = _matmul_seconds(key)
        xla += count * alone
        best += count * min(alone, _torch_matmul_seconds(key))
    return xla, best, flops


def time_pytorch(batch: dict, steps: int, compiled: bool = False) -> float:
    import torch

    model = hf_llama(MODEL, "float32", "cpu")
    if compiled:
        model = torch.compile(model)
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

    for _ in range(3 if compiled else 2):  # (torch.compile: the backward compiles on step 1)
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
    parser.add_argument("--tunix-python", default="", help="a Python with google-tunix")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args()

    import torch

    batch = _batch(args.batch, args.seq)
    tokens = args.batch * args.seq
    threads = torch.get_num_threads()
    rows = {f"HF transformers + PyTorch eager ({threads} threads)": time_pytorch(batch, args.steps)}
    if not args.no_compile:
        rows[f"HF transformers + torch.compile ({threads} threads)"] = time_pytorch(
            batch, args.steps, compiled=True
        )
    if args.tunix_python:
        rows["Tunix PeftTrainer (full parameters)"] = time_tunix(args)
    rows["posttrain (jit, XLA)"] = time_posttrain(batch, args.steps)
    baseline = next(iter(rows.values()))
    fastest_peer = min(v for k, v in rows.items() if not k.startswith("posttrain"))
    print(
        f"\n{MODEL.name}: {num_params(MODEL) / 1e6:.1f}M params, batch {args.batch} x "
        f"{args.seq}, AdamW step, float32, {cpu_model()}, {vector_extensions()}\n"
    )
    print("| implementation | step (ms) | tokens/s | vs PyTorch eager | vs fastest peer |")
    print("|---|---|---|---|---|")
    for name, seconds in rows.items():
        print(
            f"| {name} | {seconds * 1e3:.0f} | {tokens / seconds:,.0f} | "
            f"{baseline / seconds:.2f}x | {fastest_peer / seconds:.2f}x |"
        )
    xla, roofline, flops = matmul_roofline(batch)
    ours = rows["posttrain (jit, XLA)"]
    print(
        f"\nThe posttrain step's matmuls, {flops / 1e9:.1f} GFLOP, each shape timed alone: "
        f"{xla * 1e3:.0f} ms in XLA's kernels, {roofline * 1e3:.0f} ms in the faster of XLA's "
        f"and PyTorch's per shape ({flops / roofline / 1e9:.0f} GFLOP/s, the roofline). The "
        f"step runs at {roofline / ours:.0%} of the roofline ({xla / ours:.0%} of XLA's)."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu_model(), "vector_extensions":
                       vector_extensions(), "seconds_per_step": rows,
                       "matmul_roofline_seconds": roofline, "matmul_xla_seconds": xla,
                       "matmul_gflop": flops / 1e9},
                      f, indent=2)  # fmt: skip


def time_tunix(args) -> float:
    """Tunix's PeftTrainer in its own venv (benchmarks/_sft_tunix.py) on the same batch."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "tunix.json")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sft_tunix.py")
        subprocess.run([args.tunix_python, script, f"--batch={args.batch}", f"--seq={args.seq}",
                        f"--steps={args.steps}", "--out", out], check=True)  # fmt: skip
        with open(out) as f:
            return json.load(f)["seconds_per_step"]


if __name__ == "__main__":
    main()
