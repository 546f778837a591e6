"""`posttrain train`: the method the config names, in a workdir (resumes its latest checkpoint)."""

from __future__ import annotations

import os
import sys

from posttrain import errors
from posttrain.cli._flags import check_folder, config_flag, define_distributed, join, parse
from posttrain.errors import EXIT_PREEMPTED, UserError

HELP = (
    "Train with the method the config names (sft, dpo, rm, grpo, ppo); resumes from the "
    "workdir's latest checkpoint. Override any config field with --config.a.b=value.",
    [
        "posttrain train --config=configs/sft.py:tiny --workdir=runs/sft_tiny",
        "posttrain train --config=configs/grpo.py:tiny --workdir=runs/grpo "
        "--config.train.steps=50 --config.rollout.num_generations=4",
    ],
)

# Collective errors that mean a peer process is gone (gloo on CPU, NCCL on GPU, JAX's
# coordination service everywhere).
_LOST_PEER = (
    "Gloo", "Connection reset", "NCCL", "coordination service", "heartbeat", "UNAVAILABLE",
)  # fmt: skip


def main(argv: list[str]) -> int:
    def define(flags, fv):
        config_flag(fv, argv)
        flags.DEFINE_string(
            "workdir", None, "output directory (checkpoints, metrics)", flag_values=fv
        )
        define_distributed(fv)

    fv = parse(argv, define, HELP)
    if fv.config is None or not fv.workdir:
        raise UserError("--config=configs/<method>.py[:preset] and --workdir=DIR are required")
    check_folder("workdir", fv.workdir)
    several = join(fv)
    from posttrain.methods import run_from_config

    try:
        summary = run_from_config(fv.config, fv.workdir)
    except BaseException:
        if not several:
            raise
        _leave_the_run()
    for r in summary.get("rounds", ()):  # iterative DPO
        print(f"round {r['round']}: {r['pairs']} pairs from {r['prompts']} prompts (on-policy "
              f"reward {r['mean_reward']:.3f}); DPO {r['stopped']}")  # fmt: skip
    if summary["stopped"] == "preempted":  # not done: a scheduler should requeue the job
        print(f"saved at step {summary['final_step']} after SIGTERM; rerun to resume: {fv.workdir}")
        return EXIT_PREEMPTED
    print(f"finished at step {summary['final_step']} ({summary['stopped']}); workdir: {fv.workdir}")
    return 0


def _leave_the_run() -> None:
    """The other processes wait for this one in their next collective; leave at once (JAX's
    heartbeat and their watchdogs stop them) rather than hang in shutdown."""
    import traceback

    import jax

    from posttrain.cli._errors import exit_code, message

    error, where = sys.exc_info()[1], f"process {jax.process_index()} of {jax.process_count()}"
    code = exit_code(error)
    if code != errors.EXIT_BUG:  # the same user error (or stop) on every process
        print(f"posttrain train: {where}: {message(error)}", file=sys.stderr, flush=True)
        os._exit(code)
    traceback.print_exc()
    if isinstance(error, jax.errors.JaxRuntimeError) and any(k in str(error) for k in _LOST_PEER):
        print(
            f"posttrain: {where} lost contact with another process (it probably died: see "
            "its log); stopping. Resume from the last checkpoint once every host is up.",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"posttrain: {where} failed (above); stopping it, the other processes stop "
            "when they miss it",
            file=sys.stderr,
            flush=True,
        )
    os._exit(1)
