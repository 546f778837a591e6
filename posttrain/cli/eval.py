"""`posttrain eval`: a suite on every checkpoint of a run (or one step, or an HF model)."""

from __future__ import annotations

from posttrain.cli._flags import config_flag, define_mesh, mesh, parse
from posttrain.errors import UserError

HELP = (
    "Evaluate every checkpoint of a run (or one --step, or an HF model directory) on a "
    "suite's general (held-out loss), target (accuracy by verifier, pass@k, preferences) "
    "and safety (refusal / compliance) tasks; writes <workdir>/eval/metrics.jsonl, "
    "table.md and table.csv, one row per checkpoint. See docs/eval.md.",
    [
        "posttrain eval --workdir=runs/demo/sft --config=configs/eval.py:demo",
        "posttrain eval --model=HF_DIR --config=configs/eval.py:template "
        "--config.target.arithmetic.max_examples=100",
        "posttrain eval --workdir=gs://bucket/run --config=configs/eval.py:demo "
        "--mesh=fsdp=4,tensor=2",
    ],
)


def main(argv: list[str]) -> int:
    """`argv[0]` is the program name ("posttrain eval"), then its flags."""

    def define(flags, fv):
        config_flag(fv, argv)
        flags.DEFINE_string(
            "workdir", None, "a training run directory: all its checkpoints (or --step)",
            flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_string(
            "model", None, "or an HF model directory (config.json + safetensors)", flag_values=fv
        )
        flags.DEFINE_integer("step", None, "only this checkpoint step", flag_values=fv)
        flags.DEFINE_string(
            "tokenizer", None, "tokenizer directory (default: the config's, the run's or the "
            "HF dir)", flag_values=fv,
        )  # fmt: skip
        flags.DEFINE_string(
            "out", None, "report directory (default: <workdir or model>/eval)", flag_values=fv
        )
        define_mesh(fv)

    fv = parse(argv, define, HELP)
    if fv.config is None or bool(fv.workdir) == bool(fv.model):
        raise UserError(
            "--config=configs/eval.py:<preset> and one of --workdir=DIR or --model=HF_DIR are "
            "required (see --help)"
        )
    from posttrain.eval import evaluate_checkpoints

    evaluate_checkpoints(
        fv.workdir or fv.model,
        fv.config,
        fv.step,
        tokenizer=fv.tokenizer,
        out_dir=fv.out,
        mesh=mesh(fv.mesh),
    )
    return 0
