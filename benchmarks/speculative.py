"""Speculative decoding on repetitive text: the engine with prompt lookup (`generate_speculative`)
vs the same engine without it (`generate_continuous`) and the static sampler (`generate`); same
weights, same prompts, greedy, identical outputs (asserted), float32 on CPU.

    python benchmarks/speculative.py --batch=8 --prompt=64 --new=128 --k=4 --ngram=3

The model is generate_throughput.py's random-init Llama (4 layers, d=256, V=4096), built with
transformers and imported with `from_hf`. Each prompt repeats a random "sentence" of 6-16 tokens
up to `prompt` tokens; a greedy random model also falls into loops of its own, which prompt
lookup then predicts. Prints one markdown table row per batch size (`--batch=1,8`).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
from _machine import cpu_model  # benchmarks/ is the script directory
from generate_throughput import HF_CONFIG, benchmark_llama  # benchmarks/ is the script directory

from posttrain.models import num_params
from posttrain.sampling import PromptLookup, generate, generate_continuous, generate_speculative


def _race(fns, repeats: int):
    """Fastest seconds of each function and its result; after one warm-up (compile) call each,
    the functions take turns, so a load change on a shared machine hits both alike."""
    results = [fn() for fn in fns]
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            results[i] = fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best, results


def _prompts(rs, count: int, length: int, vocab: int) -> list[list[int]]:
    prompts = []
    for _ in range(count):
        sentence = rs.randint(1, vocab, rs.randint(6, 17)).tolist()
        prompts.append((sentence * (length // len(sentence) + 1))[:length])
    return prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length (tokens)")
    parser.add_argument("--new", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--ngram", type=int, default=3, help="longest n-gram looked up")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    _, model = benchmark_llama()

    drafter = PromptLookup(ngram=args.ngram, k=args.k)
    settings = dict(max_new_tokens=args.new, length_bucket=args.prompt)
    print(
        f"\nLlama 4 layers, d=256, V=4096 ({num_params(model.config) / 1e6:.1f}M params), "
        f"float32, greedy, prompts of {args.prompt} tokens repeating a 6-16 token sentence, "
        f"{args.new} new tokens, PromptLookup(ngram={args.ngram}, k={args.k})\n"
    )
    print(
        "| CPU | batch | generate tokens/s | engine tokens/s | engine + speculative tokens/s "
        "| vs engine | vs generate | drafts accepted | model forwards (decode) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rs = np.random.RandomState(0)
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = _prompts(rs, batch, args.prompt, HF_CONFIG["vocab_size"])
        stats = {}
        (plain_s, engine_s, spec_s), (plain, engine, spec) = _race(
            [
                partial(generate, model, None, prompts, **settings),
                partial(generate_continuous, model, None, prompts, slots=batch, **settings),
                partial(
                    generate_speculative,
                    model,
                    None,
                    prompts,
                    drafter=drafter,
                    stats=stats,
                    **settings,
                ),
            ],
            args.repeats,
        )
        ids = [[[c.token_ids for c in row] for row in out] for out in (plain, engine, spec)]
        assert ids[0] == ids[1] == ids[2], "greedy outputs differ"
        tokens = batch * args.new
        print(
            f"| {cpu_model()} | {batch} | {tokens / plain_s:,.0f} | {tokens / engine_s:,.0f} | "
            f"{tokens / spec_s:,.0f} | {engine_s / spec_s:.2f}x | {plain_s / spec_s:.2f}x | "
            f"{stats['acceptance']:.0%} | "
            f"{args.new} -> {stats['rounds']} |"
        )


if __name__ == "__main__":
    main()
