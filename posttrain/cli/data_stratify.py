"""`posttrain data stratify`: records split into difficulty buckets for a curriculum."""

from __future__ import annotations

from posttrain.cli._flags import parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "Split records into difficulty buckets (hardest first) by a pass rate or score, one file "
    "per bucket, for data.curriculum (docs/data.md).",
    [
        "posttrain data stratify --input=prompts.jsonl --score-field=pass_rate --out=buckets",
        "posttrain data stratify --input=prompts.jsonl --pass-rates=runs/grpo/difficulty.json "
        "--edges=0.2,0.8 --out=buckets",
        "posttrain data stratify --input=problems.jsonl --model=runs/demo/sft --samples=8 "
        "--max-new-tokens=8 --out=buckets",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("input", None, "records: a file or glob (JSONL/Parquet/ArrayRecord)",
                            flag_values=fv)  # fmt: skip
        flags.DEFINE_string("out", None, "folder for the bucket files", flag_values=fv)
        flags.DEFINE_string("score_field", "", "each record's pass rate or score", flag_values=fv)
        flags.DEFINE_string("pass_rates", "", "or a JSON {record index: pass rate} (an RL run's "
                            "difficulty.json)", flag_values=fv)  # fmt: skip
        flags.DEFINE_string("model", "", "or sample each record's pass rate from this checkpoint "
                            "(training workdir or HF directory)", flag_values=fv)  # fmt: skip
        flags.DEFINE_integer("samples", 8, "--model: samples per record", flag_values=fv)
        flags.DEFINE_integer("max_new_tokens", 128, "--model: completion budget", flag_values=fv)
        flags.DEFINE_float("temperature", 1.0, "--model: sampling temperature", flag_values=fv)
        flags.DEFINE_string("domain", "", "--model: reward domain of records without one",
                            flag_values=fv)  # fmt: skip
        flags.DEFINE_float("pass_threshold", 1.0, "--model: a sample passes with reward >= this",
                           flag_values=fv)  # fmt: skip
        flags.DEFINE_integer("buckets", 3, "quantile buckets (equal sizes)", flag_values=fv)
        flags.DEFINE_list("edges", [], "fixed bucket edges instead, e.g. 0.2,0.8", flag_values=fv)
        flags.DEFINE_list("names", [], "bucket names, hardest first (default hard,medium,easy "
                          "for 3, else bucket_0...)", flag_values=fv)  # fmt: skip
        flags.DEFINE_bool("higher_is_easier", True, "scores are pass rates; --nohigher-is-easier "
                          "for difficulty ratings", flag_values=fv)  # fmt: skip
        flags.DEFINE_string("format", "jsonl", "bucket files: jsonl, parquet or arrayrecord",
                            flag_values=fv)  # fmt: skip
        define_overwrite(flags, fv)

    fv = parse(argv, define, HELP)
    if not fv.input or not fv.out:
        raise UserError("--input=FILE_OR_GLOB and --out=DIR are required")
    if sum(map(bool, (fv.score_field, fv.pass_rates, fv.model))) != 1:
        raise UserError("give --score-field=FIELD, --pass-rates=FILE or --model=CHECKPOINT (one)")
    from rich.console import Console
    from rich.table import Table

    from posttrain import paths
    from posttrain.curate import bucket_names, read_pass_rates, stratify_records

    try:
        edges = [float(e) for e in fv.edges] or None
    except ValueError:
        raise UserError(f"--edges={','.join(fv.edges)}: numbers, e.g. 0.2,0.8") from None
    names = fv.names or bucket_names(len(edges) + 1 if edges else fv.buckets)
    files = [f"{n}.{fv.format}" for n in names] + ["stratify.json"]
    check_flags(fv, inputs=("input", "pass_rates"), outputs=(),
                more={f"--out={fv.out} ({f})": paths.join(fv.out, f) for f in files})  # fmt: skip
    rates = read_pass_rates(fv.pass_rates) if fv.pass_rates else None
    if fv.model:
        rates = _sampled(fv)
    report = stratify_records(
        fv.input,
        fv.out,
        score_field=fv.score_field,
        pass_rates=rates,
        num_buckets=fv.buckets,
        edges=edges,
        higher_is_easier=fv.higher_is_easier,
        names=fv.names,
        suffix="." + fv.format,
    )
    table = Table(title=f"stratify {fv.input} by {report['score']}")
    for column in ("bucket", "records", "score min", "score max", "file"):
        table.add_column(column)
    for b in report["buckets"]:
        table.add_row(b["name"], str(b["records"]), str(b["score_min"]), str(b["score_max"]),
                      b["path"])  # fmt: skip
    Console().print(table)
    if report["unscored"]:
        print(f"{report['unscored']} records without a score were left out")
    return 0


def _sampled(fv) -> dict[int, float]:
    """Each record's pass rate under --model (k samples, scored by its reward domain)."""
    from posttrain.cli._sampled import sampling_flags
    from posttrain.curate import SampleConfig, pass_rates
    from posttrain.rl import RewardsConfig
    from posttrain.train import load_model_and_tokenizer

    sampling = sampling_flags(fv)  # (before the model loads)
    try:
        model, tokenizer = load_model_and_tokenizer(fv.model)
    except FileNotFoundError as e:
        raise UserError(f"--model={fv.model}: {e}") from None
    config = SampleConfig(
        samples=fv.samples, max_new_tokens=fv.max_new_tokens, sampling=sampling,
        rewards=RewardsConfig(pass_threshold=fv.pass_threshold),
    )  # fmt: skip
    rates, _ = pass_rates(model, tokenizer, [(fv.input, fv.domain)], config)
    return rates
