"""`posttrain export`: a run's checkpoint as a Hugging Face directory (or PEFT adapters)."""

from __future__ import annotations

from posttrain.cli._flags import parse
from posttrain.errors import UserError

HELP = (
    "Write a run's checkpoint as a Hugging Face directory (config.json + safetensors).",
    ["posttrain export --workdir=runs/sft_tiny --out=runs/sft_tiny/hf --dtype=bfloat16"],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("workdir", None, "training run directory", flag_values=fv)
        flags.DEFINE_string("out", None, "HF directory to write", flag_values=fv)
        flags.DEFINE_integer("step", None, "checkpoint step (default: latest)", flag_values=fv)
        flags.DEFINE_string("dtype", None, "storage dtype, e.g. bfloat16", flag_values=fv)
        flags.DEFINE_bool(
            "merge_lora",
            True,
            "LoRA runs: write the adapters merged into the base (HF weights); "
            "--nomerge-lora writes the unmerged adapters in HF PEFT's layout",
            flag_values=fv,
        )
        flags.DEFINE_bool(
            "overwrite",
            False,
            "export into --out even if it holds files but no previous export (its config.json "
            "and *.safetensors are replaced, other files stay); a previous export there is "
            "always replaced whole",
            flag_values=fv,
        )

    fv = parse(argv, define, HELP)
    if not fv.workdir or not fv.out:
        raise UserError("--workdir=DIR and --out=HF_DIR are required")
    from posttrain.models import check_export_destination, to_hf
    from posttrain.train import export_peft, load_checkpoint_model

    check_export_destination(fv.out, overwrite=fv.overwrite)  # before a large checkpoint loads

    if not fv.merge_lora:
        export_peft(fv.workdir, fv.out, fv.step, overwrite=fv.overwrite)
        print(f"wrote the LoRA adapters (PEFT layout) to {fv.out}")
        return 0
    model = load_checkpoint_model(fv.workdir, fv.step)
    to_hf(model, fv.out, dtype=fv.dtype, overwrite=fv.overwrite)
    print(f"wrote {fv.out}")
    return 0
