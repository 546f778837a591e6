"""The smallest program found on which libtpu refuses the async collective flag set.

    python benchmarks/libtpu_flag_failure.py     # --topologies=v5p-16,v5p-128

`posttrain compile` tries libtpu's async collective set (`posttrain/_collectives.py`) on every
program and compiles without it where the compiler refuses. It refuses the Kimi K2 plans with
`RET_CHECK failure (.../llo_program_shared_registry.cc:156) ... Cannot find value
'<iteration-smem-mask-address-key...`. Reduced by hand (docs/compile.md has the steps): one MoE
layer (GQA attention, 64 experts of width 256, d=1024, 32k vocabulary; Kimi K2's routing),
an SFT step on 64 rows of 512 tokens, FSDP over every chip, no expert parallelism. It compiles
on 8 chips and fails on 64. This prints, per slice, what the plan compiled with.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from posttrain.config import load_config_file, override
from posttrain.methods import compile_plan
from posttrain.models import PRESETS

K2 = PRESETS["kimi_k2_1t"]
PRESETS["moe_flag_repro"] = K2.replace(
    name="moe_flag_repro",
    num_layers=1,
    first_k_dense=0,
    embed_dim=1024,
    vocab_size=32_768,
    num_heads=8,
    num_kv_heads=8,
    head_dim=128,
    mla=None,
    mlp_dim=2048,
    moe=dataclasses.replace(K2.moe, num_experts=64, expert_mlp_dim=256),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topologies", default="v5p-16,v5p-128")
    args = parser.parse_args()
    config = override(
        load_config_file("configs/sft.py:kimi_k2_1t"),
        {"model.preset": "moe_flag_repro", "mesh.ici.expert": 1, "data.batch_size": 64,
         "train.micro_batches": 1, "data.max_len": 512},
    )  # fmt: skip
    for topology in args.topologies.split(","):
        start = time.perf_counter()
        report = compile_plan(config, topology, programs=False)
        print(f"{topology} ({report.chips} chips): libtpu flags {report.flags} "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
