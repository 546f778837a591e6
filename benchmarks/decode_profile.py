"""Where a decode step of the paged engine goes on CPU: the engine's jitted decode calls alone
(no prefill, no host work), then the same with one part changed at a time, and the step's
matrix multiplies on their own.

    python benchmarks/decode_profile.py     # --reps=9; --ops: the engine's calls op by op

The model and prompts are `generate_throughput.py`'s (Llama, 4 layers, d=256, V=4096, float32;
8 rows, prompts of 32-64 tokens, 128 greedy tokens in 8 calls of 16 steps). Variants run in
turns, best of `--reps`; "tokens equal" compares each variant's greedy tokens with the engine's.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from generate_throughput import benchmark_llama  # noqa: E402

from posttrain.sampling import (  # noqa: E402
    Engine,
    EngineConfig,
    Request,
    _paged,  # noqa: E402
)

STEPS, CALLS = 16, 8


def _variant(**globals_):
    """`decode` re-jitted with some of its module's functions replaced."""
    raw = _paged.decode.__wrapped__
    fn = types.FunctionType(raw.__code__, {**raw.__globals__, **globals_}, raw.__name__)
    fn.__kwdefaults__ = raw.__kwdefaults__
    static = ("steps", "blocks", "block_size", "kernel", "unstack")
    return jax.jit(fn, static_argnames=static, donate_argnames=("rows",))


def _matmul_us(M, K, N, reps):
    """Microseconds of one `[M, K] @ [K, N]` float32 matmul, 16 per jitted call."""
    x, w = jnp.ones((M, K)), jnp.ones((K, N)) / K

    @jax.jit
    def f(x, w):
        step = lambda c, _: (c + (x + c[:, :1]) @ w * 0, None)  # noqa: E731
        return jax.lax.scan(step, x @ w * 0, length=16)[0]

    f(x, w).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(20):
            out = f(x, w)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - start) / 20 / 16)
    return best * 1e6


def _memory_gbs(reps: int) -> float:
    """This machine's memory read rate (GB/s): a jitted sum over 256 MB of float32, best of
    `reps` (far beyond the caches, as a decode step's weights and cache are)."""
    x = jnp.ones(64 * 2**20, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def _step_bytes(model, rows: int, tokens: int) -> float:
    """Bytes one decode step must read: every weight but the embedding table (one row per
    token), and each row's cached keys and values over `tokens` positions."""
    c = model.config
    weights = sum(a.nbytes for a in jax.tree.leaves(model.params)) - model.params["embed"].nbytes
    if "lm_head" not in model.params:  # tied: the head is the table, read whole
        weights += model.params["embed"].nbytes
    kv = rows * tokens * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    return weights + kv


def _op_table(trace_dir: str, steps: int, hlo: str) -> None:
    """The traced decode calls' XLA:CPU ops by kind (the fusion's name without its number; a
    YNNPACK kernel's also with its output shape, from the compiled program `hlo`, which tells
    the weight matmuls from attention's): microseconds per step summed over both cores'
    threads, runs per step, share."""
    shapes = dict(re.findall(r"%(ynn_fusion[.\d]*) = (\w+\[[\d,]*\])", hlo))
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    total, runs = collections.Counter(), collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                name = event.name
                if name.startswith(("ThunkExecutor", "$", "end: ")) or "Await" in name:
                    continue  # (the executor's own spans, Python frames, waits)
                kind = re.sub(r"\.\d+$", "", name)
                kind += f" {shapes[name]}" if name in shapes else ""
                total[kind] += event.duration_ns / 1e3 / steps
                runs[kind] += 1 / steps
    whole = sum(total.values())
    print(f"\nops per step: {sum(runs.values()):.0f}, {whole:.0f} us of op time per step")
    print("| op kind | us per step | runs per step | share |")
    print("|---|---|---|---|")
    for kind, us in total.most_common(20):
        print(f"| {kind} | {us:.0f} | {runs[kind]:.1f} | {us / whole:.0%} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument(
        "--ops", action="store_true", help="also trace the engine's calls and list their ops"
    )
    args = parser.parse_args()

    _, model = benchmark_llama()
    rs = np.random.RandomState(0)
    prompts = [rs.randint(1, 4096, rs.randint(32, 65)).tolist() for _ in range(8)]

    def run(decode, blocks=None, unstack=True):
        engine = Engine(model, EngineConfig(slots=8, chunk=STEPS), max_len=192)
        for i, prompt in enumerate(prompts):
            engine.submit(Request(prompt, STEPS * CALLS, jax.random.key(i)))
        engine._admit()  # prefill, outside the timing
        rows = jax.block_until_ready(engine._rows)
        start, tokens = time.perf_counter(), []
        for _ in range(CALLS):
            rows, tok, _, _ = decode(
                model,
                rows,
                engine._eos_E,
                steps=STEPS,
                blocks=blocks or engine.blocks_per_seq,
                block_size=16,
                unstack=unstack,
            )
            tokens.append(tok)
        jax.block_until_ready(rows)
        return time.perf_counter() - start, np.concatenate([np.asarray(t) for t in tokens], 1)

    no_logprobs = _variant(_token_logprobs=lambda logits, t: jnp.zeros(t.shape, jnp.float32))
    variants = {
        "engine decode calls": lambda: run(_paged.decode),
        "no per-token log-probs": lambda: run(no_logprobs),
        "attention over 1 block (16 positions)": lambda: run(_paged.decode, blocks=1),
        "stacked layers (unstack_layers=False)": lambda: run(_paged.decode, unstack=False),
    }
    reference = run(_paged.decode)[1]
    best, same = {}, {}
    for name, fn in variants.items():
        same[name] = float((fn()[1] == reference).mean())  # also compiles
    for _ in range(args.reps):
        for name, fn in variants.items():
            best[name] = min(best.get(name, float("inf")), fn()[0])
    print(f"\nCPU: {os.cpu_count()} cores; 8 rows x {STEPS * CALLS} tokens, best of {args.reps}\n")
    print("| decode calls | ms per step | tokens/s | vs engine | tokens equal |")
    print("|---|---|---|---|---|")
    base = best["engine decode calls"]
    for name, seconds in best.items():
        per_step = seconds / (STEPS * CALLS) * 1e3
        print(
            f"| {name} | {per_step:.2f} | {8 * STEPS * CALLS / seconds:,.0f} | "
            f"{base / seconds:.2f}x | {same[name]:.0%} |"
        )
    D, F, V, T = 256, 1024, 4096, 4
    shapes = {  # the step's weight matmuls (8 rows), how many of each
        f"q, o ([8,{D}] x [{D},{D}])": ((8, D, D), 2 * T),
        f"k, v ([8,{D}] x [{D},128])": ((8, D, 128), 2 * T),
        f"gate, up ([8,{D}] x [{D},{F}])": ((8, D, F), 2 * T),
        f"down ([8,{F}] x [{F},{D}])": ((8, F, D), T),
        f"lm_head ([8,{D}] x [{D},{V}])": ((8, D, V), 1),
    }
    print("\n| matmul, alone | count per step | us each | GFLOP/s | weight GB/s |")
    print("|---|---|---|---|---|")
    total = 0.0
    for name, ((M, K, N), count) in shapes.items():
        us = _matmul_us(M, K, N, args.reps)
        total += us * count
        gflops, gbs = 2 * M * K * N / us / 1e3, 4 * K * N / us / 1e3
        print(f"| {name} | {count} | {us:.0f} | {gflops:.1f} | {gbs:.1f} |")
    print(f"\nweight matmuls alone: {total / 1e3:.2f} ms per step")
    # Alone, each matmul's weights stay in the caches; a step's 20 MB of weights do not, so
    # the step's floor is reading them (and its cache) from memory.
    gbs = _memory_gbs(args.reps)
    engine_blocks = 192 // 16  # the calls above attend over every block of max_len=192
    mean_tokens = np.mean([len(p) for p in prompts]) + STEPS * CALLS / 2
    read, read_mean = (_step_bytes(model, 8, n) for n in (16 * engine_blocks, mean_tokens))
    floor = read / gbs / 1e6
    print(
        f"memory: {read / 1e6:.1f} MB read per step (weights, and the cache over "
        f"{engine_blocks} blocks a row; {read_mean / 1e6:.1f} MB at the rows' mean length) at "
        f"{gbs:.1f} GB/s: {floor:.2f} ms per step; the engine's step is "
        f"{base / (STEPS * CALLS) * 1e3 / floor:.2f}x that"
    )
    if args.ops:  # the engine's calls under the profiler (which slows each op a little)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                run(_paged.decode)
            engine = Engine(model, EngineConfig(slots=8, chunk=STEPS), max_len=192)
            hlo = _paged.decode.lower(
                model, engine._rows, engine._eos_E, steps=STEPS, blocks=engine.blocks_per_seq,
                block_size=16,
            ).compile().as_text()  # fmt: skip
            _op_table(trace_dir, STEPS * CALLS, hlo)


if __name__ == "__main__":
    main()
