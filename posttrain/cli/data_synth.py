"""`posttrain data synth`: rejection-sampled SFT data from a teacher checkpoint."""

from __future__ import annotations

from posttrain.cli._flags import define_distributed, join, parse
from posttrain.cli._sampled import define_sampling, load, print_counts

HELP = (
    "Rejection-sampled SFT data: sample k completions per prompt from a teacher checkpoint, "
    "verify them with the prompt's reward domain, and keep those that end and pass as "
    "prompt/completion records (docs/data.md).",
    [
        "posttrain data synth --model=runs/teacher --prompts=problems.jsonl "
        "--domain=arithmetic --samples=8 --max-new-tokens=8 --out=synth.jsonl",
        "posttrain data synth --model=HF_DIR --prompts=math.parquet --samples=16 "
        "--threshold=1.0 --per-prompt=2 --out=gs://bucket/rft.arrayrecord",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        define_distributed(fv)
        define_sampling(flags, fv, samples=8)
        flags.DEFINE_float("threshold", None, "keep samples with reward >= this (default: "
                           "--pass-threshold)", flag_values=fv)  # fmt: skip
        flags.DEFINE_bool("require_end", True, "keep only completions that ended with EOS "
                          "(--norequire-end: cut ones too)", flag_values=fv)  # fmt: skip
        flags.DEFINE_integer("per_prompt", 1, "completions kept per prompt at most",
                             flag_values=fv)  # fmt: skip

    fv = parse(argv, define, HELP)
    join(fv)  # (several processes: each samples its share of every chunk; process 0 writes)
    model, tokenizer, sources, config = load(fv)
    from posttrain.curate import synthesize

    stats = synthesize(
        model, tokenizer, sources, fv.out, config, threshold=fv.threshold,
        per_prompt=fv.per_prompt, require_end=fv.require_end,
    )  # fmt: skip
    print_counts(f"synth from {fv.model} -> {fv.out}", stats)
    return 0
