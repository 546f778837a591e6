"""`posttrain data cad`: CAD task files from the bundled generator (docs/cad.md)."""

from __future__ import annotations

from posttrain.cli._flags import parse
from posttrain.cli._outputs import check_flags, define_overwrite
from posttrain.errors import UserError

HELP = (
    "CAD tasks from the bundled generator (plates, brackets, flanges, gears, enclosures): RL "
    "prompt files (train.jsonl, held-out eval.jsonl), SFT chats (sft.jsonl) and tool-call "
    "trajectories (trajectories.jsonl) from the reference scripts, and a 512-token tokenizer "
    "for a model trained from scratch; the same files for the same flags (docs/cad.md).",
    [
        "posttrain data cad --out=runs/cad/assets",
        "posttrain data cad --out=data/cad --sft=10000 --train=4000 --eval=256 --levels=2,3",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("out", None, "directory to write into", flag_values=fv)
        flags.DEFINE_integer("sft", 3000, "SFT tasks (chats and trajectories)", flag_values=fv)
        flags.DEFINE_integer("train", 1000, "RL training prompts", flag_values=fv)
        flags.DEFINE_integer("eval", 64, "held-out prompts (in no other file)", flag_values=fv)
        flags.DEFINE_list("levels", ["1", "2", "3"], "difficulty levels, comma-separated: "
                          "1 plates, 2 brackets and flanges, 3 gears and enclosures",
                          flag_values=fv)  # fmt: skip
        flags.DEFINE_integer("seed", 0, "seeds every draw", flag_values=fv)
        flags.DEFINE_enum("aggregate", "gated", ["gated", "mean"], "the RL prompts' reward "
                          "total: gated (a missing required feature caps it) or the weighted "
                          "mean of its components", flag_values=fv)  # fmt: skip
        define_overwrite(flags, fv)

    fv = parse(argv, define, HELP)
    if not fv.out:
        raise UserError("set --out=DIR, the directory to write into")
    if any(n < 1 for n in (fv.sft, fv.train, fv.eval)):
        raise UserError("--sft, --train and --eval must be at least 1")
    if not fv.levels or any(level not in ("1", "2", "3") for level in fv.levels):
        raise UserError(f"--levels takes 1, 2 and 3, got {fv.levels}")
    import os

    from posttrain.curate import CAD_ASSET_FILES, build_cad_assets

    files = {f"--out={fv.out} ({f})": os.path.join(fv.out, f) for f in CAD_ASSET_FILES}
    check_flags(fv, inputs=(), outputs=(), more=files)

    try:
        paths = build_cad_assets(
            fv.out, n_sft=fv.sft, n_train=fv.train, n_eval=fv.eval,
            levels=tuple(int(v) for v in fv.levels), seed=fv.seed, aggregate=fv.aggregate,
            progress=True,
        )  # fmt: skip
    except ValueError as e:  # more tasks asked for than the levels hold
        raise UserError(f"{e}; ask for fewer or add levels") from None
    for name, path in paths.items():
        print(f"{name:>12}  {path}")
    return 0
