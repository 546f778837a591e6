"""Tunix's row of benchmarks/sft_throughput.py: full-parameter SFT steps with `PeftTrainer`.

Runs under its own venv (google-tunix's pins are not ours):

    /work/peers/tunix-venv/bin/python benchmarks/_sft_tunix.py --batch=8 --seq=512 --steps=10 \\
        --out /tmp/sft_tunix.json

The same model sizes as sft_throughput.py (Llama, 4 layers, d=256, V=4096, 8 q / 4 kv heads of 32,
MLP 1024, float32), built as Tunix's `Llama3` with a random init (`nnx.Rngs(0)`), trained by
`tunix.sft.peft_trainer.PeftTrainer` on every parameter (no LoRA) with
`optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.0)`, no clipping, no gradient accumulation, no
checkpoints, no eval, no metrics backends (Tunix's in-memory metrics, absl logging and its
progress bar, which is disabled off a TTY, still run). Each step sees the same batch: the rows of
`seq + 1` random tokens that sft_throughput.py draws, as a `TrainingInput` with an all-ones mask;
Tunix's default loss drops the last logit, so it is next-token cross-entropy over all `seq`
targets, but the model runs over `seq + 1` tokens (0.2% more work). Positions and the dense causal
[B, L, L] attention mask are built inside the jitted step by the usual `gen_model_input_fn` (as in
tunix/cli/peft_main.py).

Timing wraps the trainer's jitted train step on the instance and blocks on its loss, so a step
ends when its device work is done; a step's time runs from the end of the previous step, so it
includes Tunix's per-step host work in the loop (metric buffering and writing, data iteration,
input sharding, throttling). Blocking also means that host work no longer overlaps the next
step's compute, as it would with Tunix's 2 in-flight steps. The first 2 (compiling) steps are
excluded; the result is the mean over `--steps` steps.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.sft import peft_trainer, utils  # noqa: E402

VOCAB = 4096
WARMUP = 2
CONFIG = llama3.ModelConfig(
    num_layers=4,
    vocab_size=VOCAB,
    embed_dim=256,
    hidden_dim=1024,
    num_heads=8,
    head_dim=32,
    num_kv_heads=4,
    rope_theta=500_000,  # irrelevant for speed
    norm_eps=1e-5,
)


def gen_model_input_fn(x: peft_trainer.TrainingInput) -> dict:
    """TrainingInput -> the kwargs of Tunix's default loss (positions and mask from input_mask)."""
    return {
        "input_tokens": x.input_tokens,
        "input_mask": x.input_mask,
        "positions": utils.build_positions_from_mask(x.input_mask),
        "attention_mask": utils.make_causal_attn_mask(x.input_mask),
    }


def install_timer(trainer: peft_trainer.PeftTrainer) -> tuple[list[float], list[float]]:
    """Wraps the trainer's jitted step; returns lists that train() fills with step ends, losses."""
    step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
    ends, losses = [], []

    def timed(*args, **kwargs):
        out = step(*args, **kwargs)
        losses.append(float(jax.block_until_ready(out[0])))
        ends.append(time.perf_counter())
        return out

    timed.jitted_fn = step.func.jitted_fn  # train() reads train_step.func.jitted_fn._cache_size()
    trainer._jitted_train_step_fn = functools.partial(timed)  # train() reuses the cached step
    return ends, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the result here")
    args = parser.parse_args()

    tokens = np.random.RandomState(0).randint(0, VOCAB, (args.batch, args.seq + 1))
    example = jax.device_put(
        peft_trainer.TrainingInput(
            input_tokens=tokens.astype(np.int32), input_mask=np.ones(tokens.shape, np.bool_)
        )
    )
    model = llama3.Llama3(CONFIG, rngs=nnx.Rngs(0))
    trainer = peft_trainer.PeftTrainer(
        model,
        optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.0),
        peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=WARMUP + args.steps),
    ).with_gen_model_input_fn(gen_model_input_fn)
    ends, losses = install_timer(trainer)
    trainer.train([example] * (WARMUP + args.steps))

    times = np.diff(ends[WARMUP - 1 :])
    assert len(times) == args.steps, (len(ends), args.steps)
    mean = float(times.mean())
    print("step times (s):", np.round(times, 3).tolist())
    assert abs(losses[0] - np.log(VOCAB)) < 0.5, f"step-1 loss {losses[0]} is not ~ln(V)"
    assert losses[-1] < losses[0], "the loss did not decrease"
    result = {
        "implementation": "Tunix PeftTrainer (full)",
        "version": f"google-tunix {importlib.metadata.version('google-tunix')}, "
        f"jax {jax.__version__}",
        "seconds_per_step": mean,
        "tokens_per_second": args.batch * args.seq / mean,
        "losses": losses,
        "notes": (
            f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores; step time = wall time between"
            " ends of consecutive steps, each blocked on its loss, so Tunix's per-step host work"
            " (metric buffering/writing, data iteration, throttling) is included but no longer"
            f" overlaps compute; {WARMUP} compiling steps excluded; the model runs over seq + 1"
            " tokens (Tunix's default loss drops the last logit) with a dense causal mask;"
            f" losses include the {WARMUP} warm-up steps"
        ),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
