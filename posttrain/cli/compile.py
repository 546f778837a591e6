"""`posttrain compile`: AOT-compile a config's train step for a TPU slice; does it fit?"""

from __future__ import annotations

from posttrain.cli._flags import config_flag, parse
from posttrain.errors import UserError

HELP = (
    "AOT-compile the configured method's train step for a TPU slice from this host and "
    "report per-chip memory, FLOPs and whether it fits (exit code 1 if not).",
    [
        "posttrain compile --config=configs/sft.py:kimi_k2_1t --topology=v5p-1024",
        "posttrain compile --config=configs/grpo.py:qwen3_8b_v5p --topology=v5p-64 --find-smallest",
        "posttrain compile --config=configs/sft.py:llama3_70b_v5p --topology=v5p-256 --remat-sweep",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        config_flag(fv, argv)
        flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-1024, v6e-256", flag_values=fv)
        flags.DEFINE_integer("num_slices", 1, "slices joined over DCN", flag_values=fv)
        flags.DEFINE_bool(
            "find_smallest", False, "also search the smallest slice it fits on", flag_values=fv
        )
        flags.DEFINE_bool(
            "remat_sweep",
            False,
            "also compile the plan once per layer remat policy and name the fastest that fits",
            flag_values=fv,
        )

    fv = parse(argv, define, HELP)
    if fv.config is None or not fv.topology:
        raise UserError("--config=configs/<method>.py:preset and --topology=v5p-1024 are required")
    from posttrain.aot import remat_lines, suggestion
    from posttrain.methods import compile_plan, remat_sweep, smallest_fit

    report = compile_plan(fv.config, fv.topology, num_slices=fv.num_slices)
    print("\n".join(report.lines()))
    if fv.find_smallest:
        generation = fv.topology.split("-")[0]
        name, _ = smallest_fit(fv.config, generation)
        print(f"smallest {generation} slice it fits on: {name or 'none up to 8192 chips'}")
    if fv.remat_sweep:
        sweep = remat_sweep(
            fv.config, fv.topology, num_slices=fv.num_slices, known=report, progress=True
        )
        print("\n".join(remat_lines(sweep)))
    if report.fits:
        print("fits")
        return 0
    print(f"does not fit: {suggestion(report)}")
    return 1
