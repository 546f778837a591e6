"""`posttrain demo`: SFT, DPO and GRPO of the bundled tiny model on the arithmetic task."""

from __future__ import annotations

from posttrain.cli._flags import parse

HELP = (
    "SFT, DPO and GRPO of a tiny model on a bundled arithmetic task, on CPU (~7 minutes).",
    ["posttrain demo --workdir=runs/demo"],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("workdir", "runs/demo", "where the demo writes", flag_values=fv)

    fv = parse(argv, define, HELP)
    from posttrain.demo import run_demo

    run_demo(fv.workdir)
    return 0
