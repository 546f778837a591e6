"""`posttrain export`: a run's checkpoint as a Hugging Face directory (or PEFT adapters)."""

from __future__ import annotations

import json

from posttrain import paths
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
        flags.DEFINE_string(
            "source",
            None,
            "VLMs: the HF directory the run's model was loaded from (default: the run's "
            "model.hf_path), whose encoder tensors the model does not run are copied into the "
            "export unchanged; '' for none (a preset)",
            flag_values=fv,
        )

    fv = parse(argv, define, HELP)
    if not fv.workdir or not fv.out:
        raise UserError("--workdir=DIR and --out=HF_DIR are required")
    from posttrain.lora import load_checkpoint_model
    from posttrain.models import check_export_destination, to_hf
    from posttrain.train import export_peft

    check_export_destination(fv.out, overwrite=fv.overwrite)  # before a large checkpoint loads

    if not fv.merge_lora:
        export_peft(fv.workdir, fv.out, fv.step, overwrite=fv.overwrite)
        print(f"wrote the LoRA adapters (PEFT layout) to {fv.out}")
        return 0
    model = load_checkpoint_model(fv.workdir, fv.step)
    source = fv.source
    if source is None and model.config.vision is not None:
        source = _hf_source(fv.workdir)
    to_hf(model, fv.out, dtype=fv.dtype, overwrite=fv.overwrite, source=source)
    print(f"wrote {fv.out}")
    return 0


def _hf_source(workdir: str) -> str:
    """The HF directory a run's model was loaded from ("" for a preset), through the runs it
    started from (`model.checkpoint`), as each run's config.json names them."""
    seen = set()
    while workdir not in seen:
        seen.add(workdir)
        file = paths.join(workdir, "config.json")
        try:
            spec = json.loads(paths.path(file).read_text()).get("model") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise UserError(
                f"{file} does not say which HF directory the model was loaded from ({e}); a VLM "
                "export copies the encoder tensors the model does not run from it: pass "
                "--source=DIR (or --source='' for a model not loaded from one)"
            ) from None
        if spec.get("hf_path") or not spec.get("checkpoint"):
            return spec.get("hf_path", "")
        workdir = spec["checkpoint"]
    raise UserError(f"runs start from each other in a circle at {workdir}; pass --source=DIR")
