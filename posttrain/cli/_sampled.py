"""Flags that `posttrain data pairs` and `posttrain data synth` share: the checkpoint, the
prompts, how to sample and how to score."""

from __future__ import annotations

from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError


def define_sampling(flags, fv, *, samples: int) -> None:
    flags.DEFINE_string("model", None, "training workdir or HF model directory to sample from",
                        flag_values=fv)  # fmt: skip
    flags.DEFINE_list("prompts", [], "prompt records: files or globs (JSONL/Parquet/ArrayRecord, "
                      "local or gs://), each {\"prompt\", \"domain\", verifier fields}",
                      flag_values=fv)  # fmt: skip
    flags.DEFINE_string("out", None, "output file (.jsonl, .parquet or .arrayrecord)",
                        flag_values=fv)  # fmt: skip
    flags.DEFINE_string("domain", "", "reward domain of records without a 'domain' field",
                        flag_values=fv)  # fmt: skip
    flags.DEFINE_list("reward", [], "score with these instead of the built-in domains: "
                      "module:function or rm:<reward model dir> (for --domain's records)",
                      flag_values=fv)  # fmt: skip
    flags.DEFINE_string("tokenizer", "", "tokenizer directory (default: the model's)",
                        flag_values=fv)  # fmt: skip
    flags.DEFINE_integer("samples", samples, "completions per prompt", flag_values=fv)
    flags.DEFINE_integer("max_new_tokens", 128, "completion budget", flag_values=fv)
    flags.DEFINE_integer("max_prompt_len", 512, "longer prompts are skipped (counted)",
                         flag_values=fv)  # fmt: skip
    flags.DEFINE_float("temperature", 1.0, "sampling temperature", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0: all)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "sampling seed (same inputs and seed: same file)",
                         flag_values=fv)  # fmt: skip
    flags.DEFINE_integer("offset", 0, "skip this many usable prompts first", flag_values=fv)
    flags.DEFINE_integer("limit", 0, "use at most this many prompts (0: all)", flag_values=fv)
    flags.DEFINE_integer("chunk", 64, "prompts sampled together", flag_values=fv)
    flags.DEFINE_integer("workers", 2, "verifier processes", flag_values=fv)
    flags.DEFINE_float("timeout_s", 10.0, "verifier time per completion", flag_values=fv)
    flags.DEFINE_float("pass_threshold", 1.0, "a sample passes with reward >= this",
                       flag_values=fv)  # fmt: skip
    define_overwrite(flags, fv)


def sampling_flags(fv):
    """--temperature (with --top_p and --top_k where defined) as a `SamplingParams`; a value
    out of range is one line (exit 2)."""
    from posttrain.sampling import SamplingParams

    try:
        return SamplingParams(fv.temperature, getattr(fv, "top_p", 1.0), getattr(fv, "top_k", 0))
    except ValueError as e:
        raise UserError(f"--temperature, --top_p, --top_k: {e}") from None


def load(fv):
    """(model, tokenizer, sources [(path, domain)], SampleConfig) of the parsed flags."""
    if not fv.model or not fv.prompts or not fv.out:
        raise UserError("--model=CHECKPOINT, --prompts=FILE and --out=FILE are required")
    if fv.reward and not fv.domain:
        raise UserError("--reward scores --domain's records: give --domain=NAME too")
    sampling = sampling_flags(fv)  # (before the model loads)
    from posttrain import paths
    from posttrain.curate import SampleConfig
    from posttrain.data import load_tokenizer
    from posttrain.rl import RewardsConfig
    from posttrain.train import load_model_and_tokenizer

    for pattern in fv.prompts:
        if not paths.glob(pattern):
            raise UserError(f"--prompts={pattern}: no such file")
    check_flags(fv, inputs=("prompts",), outputs=("out",))
    config = SampleConfig(
        samples=fv.samples,
        max_new_tokens=fv.max_new_tokens,
        max_prompt_len=fv.max_prompt_len,
        sampling=sampling,
        seed=fv.seed,
        offset=fv.offset,
        limit=fv.limit,
        chunk=fv.chunk,
        rewards=RewardsConfig(
            domains={fv.domain: list(fv.reward)} if fv.reward else {},
            workers=fv.workers,
            timeout_s=fv.timeout_s,
            pass_threshold=fv.pass_threshold,
        ),
    )
    try:
        model, tokenizer = load_model_and_tokenizer(fv.model)
    except FileNotFoundError as e:
        raise UserError(f"--model={fv.model}: {e}") from None
    if fv.tokenizer:
        tokenizer = load_tokenizer(fv.tokenizer)
    return model, tokenizer, [(p, fv.domain) for p in fv.prompts], config


def print_counts(title: str, stats: dict) -> None:
    """The counts as a table; the first malformed records below it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("count")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        if key != "errors":
            table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console = Console()
    console.print(table)
    for error in stats["errors"]:
        console.print(f"malformed: {error}")
