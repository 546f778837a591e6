"""`posttrain data pairs`: on-policy preference pairs from a checkpoint."""

from __future__ import annotations

from posttrain.cli._flags import define_distributed, join, parse
from posttrain.cli._sampled import define_sampling, load, print_counts

HELP = (
    "On-policy preference pairs: sample k completions per prompt from a checkpoint with the "
    "generation engine, score them with the prompt's reward domain (or a reward model), and "
    "write chosen/rejected pairs with their reward margins; DPO trains on the file as it is "
    "(docs/data.md). Rounds of pairs and DPO: configs/dpo.py:iterative.",
    [
        "posttrain data pairs --model=runs/demo/sft --prompts=problems.jsonl "
        "--domain=arithmetic --samples=4 --max-new-tokens=8 --out=pairs.jsonl",
        "posttrain data pairs --model=runs/sft --prompts=gs://bucket/prompts/*.parquet "
        "--domain=chat --reward=rm:runs/rm --samples=8 --out=gs://bucket/pairs.parquet",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        define_distributed(fv)
        define_sampling(flags, fv, samples=4)
        flags.DEFINE_float("min_margin", 0.0, "keep pairs whose reward margin is above this",
                           flag_values=fv)  # fmt: skip
        flags.DEFINE_bool("require_end", True, "keep only completions that ended with EOS "
                          "(--norequire-end: cut ones too)", flag_values=fv)  # fmt: skip
        flags.DEFINE_integer("per_prompt", 1, "pairs per prompt at most (k-th best vs k-th "
                             "worst)", flag_values=fv)  # fmt: skip

    fv = parse(argv, define, HELP)
    join(fv)  # (several processes: each samples its share of every chunk; process 0 writes)
    model, tokenizer, sources, config = load(fv)
    from posttrain.curate import make_pairs

    stats = make_pairs(
        model, tokenizer, sources, fv.out, config, min_margin=fv.min_margin,
        per_prompt=fv.per_prompt, require_end=fv.require_end,
    )  # fmt: skip
    print_counts(f"pairs from {fv.model} -> {fv.out}", stats)
    return 0
