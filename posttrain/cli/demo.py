"""`posttrain demo`: SFT, DPO and GRPO of the bundled tiny model on the arithmetic task, or
(`--task=calculator`) SFT and GRPO of an agent that learns to use a calculator tool, or
(`--task=clarify`) of one that learns to ask before it codes, or (`--task=retrieval`) of one
that searches documents longer than its window (against one trained on them truncated), or
(`--task=cad`) SFT and GRPO of a model that writes CAD scripts."""

from __future__ import annotations

from posttrain.cli._flags import check_folder, parse

HELP = (
    "SFT, DPO and GRPO of a tiny model on a bundled arithmetic task, on CPU (~7 minutes); "
    "with --task=calculator, SFT and GRPO of an agent that learns to call a calculator tool; "
    "with --task=clarify, SFT and GRPO of one that learns to ask what a coding request leaves "
    "out; with --task=retrieval, SFT and GRPO of one that searches documents longer than its "
    "window, against the same recipe on the documents truncated; with --task=cad, SFT and GRPO "
    "of a model that writes CAD scripts (renders before/after).",
    [
        "posttrain demo --workdir=runs/demo",
        "posttrain demo --task=calculator --workdir=runs/agent",
        "posttrain demo --task=clarify --workdir=runs/clarify",
        "posttrain demo --task=retrieval --workdir=runs/retrieval",
        "posttrain demo --task=cad --workdir=runs/cad",
    ],
)


def main(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("workdir", "", "where the demo writes", flag_values=fv)
        flags.DEFINE_enum(
            "task",
            "arithmetic",
            ["arithmetic", "calculator", "clarify", "retrieval", "cad"],
            "arithmetic: SFT, DPO and GRPO; calculator: an agent learns to call a tool; "
            "clarify: an agent learns to ask before it codes; retrieval: an agent learns to "
            "search documents longer than its window; cad: a model learns to write CAD scripts",
            flag_values=fv,
        )
        flags.DEFINE_enum(
            "cad_reward",
            "gated",
            ["gated", "mean"],
            "with --task=cad, the reward's total: gated (a part missing a required feature is "
            "capped; docs/cad.md) or the weighted mean of its components",
            flag_values=fv,
        )

    fv = parse(argv, define, HELP)
    if fv.workdir:
        check_folder("workdir", fv.workdir)
    if fv.task == "calculator":
        from posttrain.demo import run_calculator_demo

        run_calculator_demo(fv.workdir or "runs/agent")
        return 0
    if fv.task == "clarify":
        from posttrain.demo import run_clarify_demo

        run_clarify_demo(fv.workdir or "runs/clarify")
        return 0
    if fv.task == "retrieval":
        from posttrain.demo import run_retrieval_demo

        run_retrieval_demo(fv.workdir or "runs/retrieval")
        return 0
    if fv.task == "cad":
        from posttrain.demo import run_cad_demo

        run_cad_demo(fv.workdir or "runs/cad", aggregate=fv.cad_reward)
        return 0
    from posttrain.demo import run_demo

    run_demo(fv.workdir or "runs/demo")
    return 0
