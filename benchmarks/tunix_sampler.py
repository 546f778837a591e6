"""Generation throughput: posttrain's engine vs Google Tunix's sampler on the same HF weights,
greedy, float32, on CPU.

Tunix lives in its own venv (its pins are not ours); the driver runs posttrain in-process and
re-invokes this file under that venv's Python (`--worker-io`) on the same saved weights:

    python3 -m venv /work/tunix-venv && /work/tunix-venv/bin/pip install -q google-tunix
    .venv/bin/python benchmarks/tunix_sampler.py --tunix-python=/work/tunix-venv/bin/python
    .venv/bin/python benchmarks/tunix_sampler.py --tunix-python=/work/tunix-venv/bin/python --append

(the second run appends to benchmarks/results/tunix_sampler_cpu.json instead of replacing it:
on a shared machine, the ratios of two runs are the claim, not the absolute numbers).

The model is the Llama of generate_throughput.py (4 layers, d=256, V=4096, 8 heads, 4 KV heads,
head_dim 32) with RoPE theta 1e6 instead of HF's default 1e4: Tunix's Llama3 attention calls
`apply_rope` without the config's `rope_theta` (google-tunix 0.1.7; still so on main at c7d8950,
2026-08-21), so it always rotates with its default 1e6; any other theta gives Tunix a different
model (logits off by ~0.05, a quarter of the greedy rows diverging within 16 tokens); with 1e6
its logits match HF's to 1e-6. Theta does not change the work done. The weights are
random-initialized by transformers (torch.manual_seed(0)) and saved with `save_pretrained`;
posttrain loads them with `from_hf(path, attention="xla")`, Tunix with
`tunix.models.llama3.params.create_model_from_safe_tensors` into its `Llama3` (config mapped
from the saved config.json). Workload: 8 prompts of 32-64 random token ids, 128 greedy new
tokens each, no EOS. posttrain: `generate_continuous` (paged engine, 8 slots, chunk 16, prefill
bucket 64) and `generate` (the same engine, a row per sample; runs before 2026-12-05 timed the
padded static sampler here, since retired); Tunix: `Sampler` (KV cache 64 + 128, prompts padded
to 64, temperature 0 = greedy) through an identity tokenizer (prompt strings are the ids, space
separated; pad id 0, which no prompt uses; no BOS; EOS -1, never produced). Each is compiled /
warmed up once, then timed best of `--repeats`, the three taking turns (the Tunix worker stays
up and times one call per request); tokens/s counts the 8 x 128 generated tokens.
Every row's greedy tokens (the first 16, and all 128) are compared with Tunix's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _machine import cpu_model  # benchmarks/ is the script directory

TUNIX_ROPE_THETA = 1e6  # what Tunix's Llama3 uses whatever its config says (see above)
_READY, _REPLY = "@@tunix-ready", "@@tunix-seconds "
RESULT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "tunix_sampler_cpu.json"
)


# ---------------------------------------------------------------- Tunix side (its own venv)


class _IdTokenizer:
    """Tunix's Sampler takes strings; this one maps "12 7 99" <-> [12, 7, 99]."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def bos_id(self):
        return None  # no BOS is prepended

    def eos_id(self):
        return -1  # never produced: every row decodes all its steps

    def pad_id(self):
        return 0  # prompts use ids 1..V-1


def _tunix_config(path: str):
    from tunix.models.llama3 import model as llama3

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters") or {}
    if (hf.get("rope_scaling") or {}).get("rope_type", "default") != "default" or rope.get(
        "rope_type", "default"
    ) != "default":
        raise ValueError("Tunix's Llama3 applies plain RoPE; this config scales it")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if theta != TUNIX_ROPE_THETA:
        raise ValueError(f"Tunix's Llama3 ignores rope_theta {theta}: it uses {TUNIX_ROPE_THETA}")
    if hf.get("attention_bias") or hf.get("mlp_bias") or hf.get("hidden_act", "silu") != "silu":
        raise ValueError("Tunix's Llama3 has no biases and a SiLU MLP")
    return llama3.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=theta,
        norm_eps=hf["rms_norm_eps"],
        weight_tying=hf.get("tie_word_embeddings", False),
    )


def worker(args):
    """Runs under the Tunix venv: loads the weights, warms the sampler up, then times one call
    per "run" line on stdin; at EOF writes the last call's tokens and its versions to the job
    file."""
    import importlib.metadata

    import jax
    import jax.numpy as jnp
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import params as llama3_params

    with open(args.worker_io) as f:
        job = json.load(f)
    config = _tunix_config(job["path"])
    model = llama3_params.create_model_from_safe_tensors(job["path"], config, dtype=jnp.float32)
    prompt_len, new = job["prompt_bucket"], job["new"]
    sampler = sampler_lib.Sampler(
        model,
        _IdTokenizer(),
        sampler_lib.CacheConfig(
            cache_size=prompt_len + new,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        ),
    )
    texts = [" ".join(map(str, p)) for p in job["prompts"]]

    def run():
        out = sampler(
            texts,
            max_generation_steps=new,
            max_prompt_length=prompt_len,
            temperature=0.0,
            eos_tokens=[-1],
        )
        return [[int(t) for t in row] for row in out.tokens]

    tokens = run()  # compile / warm up
    print(_READY, flush=True)
    for line in sys.stdin:  # the driver asks for one timed run at a time
        if line.strip() != "run":
            break
        start = time.perf_counter()
        tokens = run()
        print(f"{_REPLY}{time.perf_counter() - start}", flush=True)
    job.update(
        tokens=tokens,
        versions={
            "google-tunix": importlib.metadata.version("google-tunix"),
            "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
            "flax": importlib.metadata.version("flax"),
        },
        device=f"{jax.devices()[0].device_kind} x {jax.device_count()}",
    )
    with open(args.worker_io, "w") as f:
        json.dump(job, f)


class _TunixProcess:
    """The worker under the Tunix venv; `run()` times one sampler call there."""

    def __init__(self, python: str, io_path: str):
        self.io_path = io_path
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), f"--worker-io={io_path}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect(_READY)

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"the Tunix worker exited with {self.proc.wait()}")

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return float(self._expect(_REPLY))

    def finish(self) -> dict:
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            raise RuntimeError(f"the Tunix worker exited with {self.proc.returncode}")
        with open(self.io_path) as f:
            return json.load(f)


# ---------------------------------------------------------------- driver (posttrain's venv)


def _checkout() -> str:
    """The posttrain commit, "+ local changes" when posttrain/ differs from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "posttrain"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head or 'unknown'}{' + local changes' if dirty else ''}"


def main(args):
    import importlib.metadata

    import jax
    import numpy as np
    import torch
    import transformers
    from generate_throughput import HF_CONFIG  # benchmarks/ is the script directory

    from posttrain.models import from_hf, num_params
    from posttrain.sampling import generate, generate_continuous

    rs = np.random.RandomState(0)
    V, B, N, P = HF_CONFIG["vocab_size"], args.batch, args.new, args.prompt
    prompts = [rs.randint(1, V, rs.randint(P // 2, P + 1)).tolist() for _ in range(B)]

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(**HF_CONFIG, rope_theta=TUNIX_ROPE_THETA),
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        del hf
        model = from_hf(path, attention="xla")

        io_path = os.path.join(path, "tunix_job.json")
        with open(io_path, "w") as f:
            json.dump(dict(path=path, prompts=prompts, new=N, prompt_bucket=P), f)
        tunix = _TunixProcess(args.tunix_python, io_path)  # loaded, compiled, warmed up

        fns = {
            "posttrain generate_continuous (paged engine)": lambda: generate_continuous(
                model, None, prompts, max_new_tokens=N, slots=B, chunk=args.chunk, length_bucket=P
            ),
            "posttrain generate (a row per sample)": lambda: generate(
                model, None, prompts, max_new_tokens=N, length_bucket=P
            ),
        }
        outputs = {name: fn() for name, fn in fns.items()}  # compile / warm up
        # The timed runs alternate, so that load from other processes on a shared machine falls
        # on all three alike; each keeps its best.
        times = {name: [] for name in [*fns, "Tunix Sampler"]}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                outputs[name] = fn()
                times[name].append(time.perf_counter() - start)
            times["Tunix Sampler"].append(tunix.run())
        tunix = tunix.finish()

    rows = {
        name: dict(seconds=min(times[name]), tokens=[list(c[0].token_ids) for c in out])
        for name, out in outputs.items()
    }
    rows["Tunix Sampler"] = dict(seconds=min(times["Tunix Sampler"]), tokens=tunix["tokens"])
    for name, row in rows.items():
        row["all_seconds"] = times[name]

    total = B * N
    reference = rows["Tunix Sampler"]["tokens"]
    for name, row in rows.items():
        assert sum(map(len, row["tokens"])) == total, (name, list(map(len, row["tokens"])))
        row["tokens_per_s"] = total / row["seconds"]
        row["vs_tunix"] = rows["Tunix Sampler"]["seconds"] / row["seconds"]
        row["first16_rows_equal_tunix"] = float(
            np.mean([a[:16] == b[:16] for a, b in zip(row["tokens"], reference, strict=True)])
        )
        row["rows_identical_to_tunix"] = float(
            np.mean([a == b for a, b in zip(row["tokens"], reference, strict=True)])
        )

    # Tunix masks every pad-id token out of the attention, generated ones too: a 0 in the
    # greedy output would make its later tokens differ for that reason alone.
    zeros = sum(t.count(0) for t in rows["posttrain generate (a row per sample)"]["tokens"])
    if zeros:
        print(f"warning: posttrain generated the pad id 0 {zeros} times")

    cpu = cpu_model()
    ours = {
        "posttrain": _checkout(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    print(
        f"\nLlama 4 layers, d=256, V=4096, RoPE theta 1e6 "
        f"({num_params(model.config) / 1e6:.1f}M params), "
        f"float32, greedy, {B} prompts of {P // 2}-{P} random tokens, {N} new tokens each; "
        f"CPU: {cpu}; posttrain venv jax {ours['jax']}, Tunix venv google-tunix "
        f"{tunix['versions']['google-tunix']} jax {tunix['versions']['jax']} flax "
        f"{tunix['versions']['flax']}\n"
    )
    print(
        "| implementation | seconds | generated tokens/s | vs Tunix | first 16 tokens = Tunix "
        f"(rows) | all {N} tokens = Tunix (rows) |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['seconds']:.3f} | {row['tokens_per_s']:,.0f} | "
            f"{row['vs_tunix']:.2f}x | {row['first16_rows_equal_tunix']:.0%} | "
            f"{row['rows_identical_to_tunix']:.0%} |"
        )

    record = {
        "cpu": cpu,
        "devices": f"{jax.devices()[0].device_kind} x {jax.device_count()}",
        "model": {**HF_CONFIG, "rope_theta": TUNIX_ROPE_THETA, "params": num_params(model.config)},
        "workload": dict(
            prompts=B, prompt_tokens=f"{P // 2}-{P}", new_tokens=N, greedy=True, dtype="float32"
        ),
        "settings": dict(
            repeats=args.repeats, slots=B, chunk=args.chunk, length_bucket=P, tunix_cache=P + N
        ),
        "versions": {"posttrain_venv": ours, "tunix_venv": tunix["versions"]},
        "results": {
            name: {k: v for k, v in row.items() if k != "tokens"} for name, row in rows.items()
        },
        "pad_id_generated": zeros,
        "first16_tokens": {name: [t[:16] for t in row["tokens"]] for name, row in rows.items()},
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    runs_so_far = []
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            runs_so_far = json.load(f)["runs"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "benchmarks/tunix_sampler.py (posttrain engine vs Tunix Sampler)",
                "runs": [*runs_so_far, record],
            },
            f,
            indent=1,
        )
        f.write("\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tunix-python", default="/work/tunix-venv/bin/python")
    parser.add_argument("--batch", type=int, default=8, help="prompts / decode slots")
    parser.add_argument("--prompt", type=int, default=64, help="longest prompt (tokens)")
    parser.add_argument("--new", type=int, default=128, help="greedy tokens per prompt")
    parser.add_argument("--chunk", type=int, default=16, help="engine decode steps per call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=RESULT)
    parser.add_argument("--append", action="store_true", help="add a run to --out's runs")
    parser.add_argument("--worker-io", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.worker_io:
        worker(cli)
    else:
        main(cli)
