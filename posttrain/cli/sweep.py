"""`posttrain sweep`: every trial of a grid or random search, each in its own workdir."""

from __future__ import annotations

from posttrain.cli._flags import check_folder, config_flag, parse
from posttrain.errors import UserError

HELP = (
    "Run every trial of a sweep file (grid or random search over config keys, once per "
    "seed), each in DIR/<trial>; print and write DIR/summary.csv. Re-running skips "
    "finished trials and resumes the others. See docs/sweeps.md.",
    [
        "posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/lr_seeds",
        "posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/lr_seeds --dry-run",
    ],
)


def main(argv: list[str]) -> int:
    """`argv[0]` is the program name ("posttrain sweep"), then its flags; exit code 1 when a
    trial did not finish."""
    if not argv or argv[0].startswith("-"):
        argv = ["posttrain sweep", *argv]

    def define(flags, fv):
        config_flag(fv, argv)
        flags.DEFINE_string("workdir", None, "the sweep's directory", flag_values=fv)
        flags.DEFINE_bool(
            "dry_run", False, "print one `posttrain train` command per trial and run nothing",
            flag_values=fv,
        )  # fmt: skip

    fv = parse(argv, define, HELP)
    if fv.config is None or not fv.workdir:
        raise UserError("--config=configs/sweeps/<name>.py and --workdir=DIR are required")
    check_folder("workdir", fv.workdir)
    from posttrain.methods import run_sweep

    rows = run_sweep(fv.config, fv.workdir, dry_run=fv.dry_run)
    return 0 if fv.dry_run or all(r["status"] == "finished" for r in rows) else 1
