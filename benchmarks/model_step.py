"""Training-step throughput of the posttrain decoder against HF transformers (PyTorch), same run.

Both sides run the same Llama-style model (bf16 weights and compute) on the same batch, timing a
forward + backward pass of the mean next-token loss (no optimizer). posttrain runs with each
attention implementation available on the backend.

    python benchmarks/model_step.py --preset=1b --batch=4 --seq=2048 --steps=10 [--json=OUT]

On CPU use `--preset=tiny` (seconds); the 1B config is meant for one GPU (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from _peers import hf_llama  # benchmarks/ is the script directory

from posttrain.models import ModelConfig, Transformer, get_preset, init_params, num_params

CONFIGS = {
    "tiny": get_preset("tiny"),
    "1b": ModelConfig(
        vocab_size=32_000,
        embed_dim=2048,
        num_layers=16,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=5632,
        rope_theta=500_000.0,
        norm_eps=1e-5,
        name="1b",
    ),
}


def time_jax(config: ModelConfig, tokens: np.ndarray, steps: int) -> float:
    params = init_params(config, jax.random.key(0))

    def loss(params, tokens):
        logits = Transformer(params, config)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    step = jax.jit(jax.value_and_grad(loss))
    tokens = jnp.asarray(tokens)
    jax.block_until_ready(step(params, tokens))  # compile
    jax.block_until_ready(step(params, tokens))
    start = time.perf_counter()
    for _ in range(steps):
        out = step(params, tokens)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def time_torch(config: ModelConfig, tokens: np.ndarray, steps: int, dtype: str) -> float:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = hf_llama(config, dtype, device)
    tokens_t = torch.tensor(tokens, dtype=torch.long, device=device)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(tokens_t[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens_t[:, 1:].flatten())
        loss.backward()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step(), step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    config = CONFIGS[args.preset].replace(param_dtype=args.dtype, compute_dtype=args.dtype)
    tokens = (
        np.random.RandomState(0)
        .randint(0, config.vocab_size, (args.batch, args.seq + 1))
        .astype(np.int32)
    )
    impls = {"cpu": ["xla"], "gpu": ["xla", "cudnn"], "tpu": ["xla", "splash"]}[
        jax.default_backend()
    ]
    rows = {"HF transformers (torch, sdpa)": time_torch(config, tokens, args.steps, args.dtype)}
    for impl in impls:
        rows[f"posttrain (attention={impl})"] = time_jax(
            config.replace(attention=impl), tokens, args.steps
        )
    flops = config.flops_per_token(args.seq) * args.batch * args.seq
    tokens_per_step = args.batch * args.seq
    baseline = rows["HF transformers (torch, sdpa)"]
    print(
        f"\n{config.name}: {num_params(config) / 1e9:.2f}B params, batch {args.batch} x "
        f"{args.seq} tokens, {args.dtype}, fwd+bwd, {jax.devices()[0].device_kind}\n"
    )
    print("| implementation | step (ms) | tokens/s | model TFLOP/s | speed vs HF |")
    print("|---|---|---|---|---|")
    for name, seconds in rows.items():
        print(
            f"| {name} | {seconds * 1e3:.1f} | {tokens_per_step / seconds:,.0f} | "
            f"{flops / seconds / 1e12:.1f} | {baseline / seconds:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "device": jax.devices()[0].device_kind,
                    "seconds_per_step": rows,
                    "model_flops_per_step": flops,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
