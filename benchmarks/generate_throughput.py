"""Generation throughput: posttrain (batch at a time and continuous batching) vs HF transformers
`generate`, same weights, same prompts, greedy, float32 on CPU.

    python benchmarks/generate_throughput.py --batch=8 --prompt=64 --new=128 --requests=32

Two workloads, generated tokens/s (only the tokens each request asked for count):
uniform: `batch` prompts, each `new` tokens, one batch.
skewed: `requests` prompts; one in eight asks for `new` tokens, the rest `new // 8`. HF and the
`generate` path take them `batch` at a time (each batch decodes until its longest request is done);
continuous batching (the paged engine) keeps `batch` slots busy.
groups: GRPO-style, `groups` prompts of `group_prompt` tokens, n=8 samples each of `group_new`
tokens (temperature 1): the engine with and without prefix sharing (a group's prompt prefilled
once, its full KV blocks shared), and `generate` (the same engine, a row per sample). Runs
before 2026-12-05 timed the padded static sampler (since retired) where `generate` is now.
Then the KV memory per token of each cache type, and the int8 cache's speed and greedy agreement.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np

from posttrain.models import PagedKVCache, from_hf, get_preset, num_params
from posttrain.sampling import generate, generate_continuous

HF_CONFIG = dict(  # a Llama-style model big enough to be non-trivial on CPU
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def benchmark_llama():
    """The benchmark's Llama in transformers (seed 0, SDPA attention, eval mode) and the same
    weights loaded with `from_hf` (XLA attention)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(**HF_CONFIG), attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        return hf, from_hf(path, attention="xla")


def _best(fn, repeats: int) -> float:
    fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _hf_generate(hf, prompts, new_tokens):
    import torch

    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return [row[L:].tolist() for row in out]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="batch size / decode slots")
    parser.add_argument("--prompt", type=int, default=64, help="longest prompt (tokens)")
    parser.add_argument("--new", type=int, default=128, help="longest completion (tokens)")
    parser.add_argument("--requests", type=int, default=32, help="requests in the skewed run")
    parser.add_argument("--chunk", type=int, default=16, help="decode steps per host sync")
    parser.add_argument("--groups", type=int, default=4, help="prompts in the groups run")
    parser.add_argument("--group-prompt", type=int, default=384, help="groups: prompt tokens")
    parser.add_argument("--group-new", type=int, default=32, help="groups: new tokens")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch

    hf, model = benchmark_llama()

    rs = np.random.RandomState(0)
    V, B, N = HF_CONFIG["vocab_size"], args.batch, args.new
    prompts = [
        rs.randint(1, V, rs.randint(args.prompt // 2, args.prompt + 1)).tolist()
        for _ in range(args.requests)
    ]
    budgets = [N if i % 8 == 3 else max(N // 8, 1) for i in range(args.requests)]
    bucket = dict(length_bucket=args.prompt)

    uniform = prompts[:B]
    ours = generate(model, None, uniform, max_new_tokens=N, **bucket)
    theirs = _hf_generate(hf, uniform, N)
    agree = np.mean(
        [a[0].token_ids[:16] == tuple(b[:16]) for a, b in zip(ours, theirs, strict=True)]
    )

    def workload(ps, bs):
        """The three implementations on prompts `ps` wanting `bs` tokens; HF and `generate` take
        `B` at a time."""
        groups = [(ps[s : s + B], max(bs[s : s + B])) for s in range(0, len(ps), B)]
        threads = torch.get_num_threads()
        return sum(bs), {
            f"HF transformers generate ({threads} threads)": lambda: [
                _hf_generate(hf, g, m) for g, m in groups
            ],
            "posttrain generate (batch at a time)": lambda: [
                generate(model, None, g, max_new_tokens=m, **bucket) for g, m in groups
            ],
            "posttrain engine (generate_continuous)": lambda: generate_continuous(
                model, None, ps, max_new_tokens=bs, slots=B, chunk=args.chunk, **bucket
            ),
        }

    runs = {"uniform": workload(uniform, [N] * B), "skewed": workload(prompts, budgets)}
    G, n = args.groups, 8
    group_prompts = [rs.randint(1, V, args.group_prompt).tolist() for _ in range(G)]
    sampled = dict(max_new_tokens=args.group_new, n=n, temperature=1.0, seeds=list(range(G)))

    def engine(sharing, kv_dtype="auto"):
        return lambda: generate_continuous(
            model,
            None,
            group_prompts,
            slots=G * n,
            chunk=args.chunk,
            prefix_sharing=sharing,
            kv_dtype=kv_dtype,
            **sampled,
        )

    runs["groups"] = (
        G * n * args.group_new,
        {
            "posttrain engine, no prefix sharing": engine(False),
            "posttrain engine, prefix sharing": engine(True),
            "posttrain generate (a row per sample)": lambda: generate(
                model, None, group_prompts, **sampled
            ),
        },
    )
    int8 = generate_continuous(model, None, uniform, max_new_tokens=N, kv_dtype="int8")
    same = sum(
        a == b
        for x, y in zip(ours, int8, strict=True)
        for a, b in zip(x[0].token_ids, y[0].token_ids, strict=True)
    )
    runs["uniform, int8 KV"] = (
        B * N,
        {
            "posttrain engine, model-dtype KV": lambda: generate_continuous(
                model, None, uniform, max_new_tokens=N, slots=B, chunk=args.chunk, **bucket
            ),
            "posttrain engine, int8 KV": lambda: generate_continuous(
                model,
                None,
                uniform,
                max_new_tokens=N,
                slots=B,
                chunk=args.chunk,
                **bucket,
                kv_dtype="int8",
            ),
        },
    )
    print(
        f"\nLlama 4 layers, d=256, V=4096 ({num_params(model.config) / 1e6:.1f}M params), "
        f"float32, greedy, batch/slots {B}, prompts {args.prompt // 2}-{args.prompt} tokens, "
        f"{jax.devices()[0].device_kind} ({os.cpu_count()} cores); first 16 greedy tokens "
        f"equal to HF in {agree:.0%} of rows\n"
    )
    print(
        f"int8 KV: greedy tokens equal to the model-dtype cache's, position by position: "
        f"{same / (B * N):.1%}\n"
    )
    print("| workload | implementation | seconds | generated tokens/s | vs first row |")
    print("|---|---|---|---|---|")
    for workload, (tokens, fns) in runs.items():
        baseline = None
        for name, fn in fns.items():
            seconds = _best(fn, args.repeats)
            baseline = baseline or seconds
            print(
                f"| {workload} | {name} | {seconds:.2f} | {tokens / seconds:,.0f} | "
                f"{baseline / seconds:.2f}x |"
            )
    _memory_table(model)


def _memory_table(model):
    print("\n| model | KV cache | bytes per token (all layers) | vs model dtype |")
    print("|---|---|---|---|")
    for name, config in (
        ("this benchmark's (float32)", model.config),
        ("llama3_8b (bfloat16)", get_preset("llama3_8b").replace(compute_dtype="bfloat16")),
        (
            "deepseek_v3 (MLA latent, bfloat16)",
            get_preset("deepseek_v3_671b").replace(compute_dtype="bfloat16"),
        ),
    ):
        full = PagedKVCache.bytes_per_token(config)
        for kind in ("auto", "int8"):
            size = PagedKVCache.bytes_per_token(config, kind)
            label = "model dtype" if kind == "auto" else "int8 + float16 scales"
            print(f"| {name} | {label} | {size:,} | {size / full:.2f}x |")


if __name__ == "__main__":
    main()
