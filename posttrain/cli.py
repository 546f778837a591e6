"""`posttrain <command>`: a thin entry point. Each command parses its flags and calls a library
function that a notebook can call the same way."""

from __future__ import annotations

import glob
import os
import sys

USAGE = """usage: posttrain <command> [flags]

commands:
  train      train a model (--config=configs/<method>.py[:preset] --workdir=DIR
             [--config.a.b=value ...])
  generate   sample from a model (--model=HF_DIR_OR_WORKDIR --prompt=TEXT [--chat]
             [--max-new-tokens=N] | --prompts-file=FILE [--out=JSONL])
  eval       evaluate a run's checkpoints or an HF model on a suite (--workdir=DIR |
             --model=HF_DIR --config=configs/eval.py:demo)
  export     write a checkpoint as a Hugging Face directory (--workdir=DIR --out=HF_DIR)
  compile    AOT-compile the train step for a TPU slice and report memory, FLOPs and fit
             (--config=configs/<method>.py:preset --topology=v5p-1024 [--num-slices=N]
             [--find-smallest])
  sweep      run a grid or random search over config keys
             (--config=configs/sweeps/<name>.py --workdir=DIR [--dry-run])
  demo       the end-to-end demo on a bundled tiny model and task (--workdir=DIR)
"""

# Commands whose drivers have not landed yet, with the issue that brings each one.
_PENDING: dict[str, str] = {}


def _normalize(argv: list[str]) -> list[str]:
    """Accepts --max-new-tokens as well as absl's --max_new_tokens."""
    return [argv[0]] + [
        a.split("=", 1)[0].replace("-", "_").replace("__", "--", 1)
        + ("=" + a.split("=", 1)[1] if "=" in a else "")
        if a.startswith("--")
        else a
        for a in argv[1:]
    ]


def _config_flag(fv, argv: list[str]) -> None:
    """`--config=configs/<method>.py[:preset]` with `--config.a.b=value` overrides, read from
    `argv` (not sys.argv, so `main([...])` from Python overrides the same way)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config",
        None,
        "configs/<method>.py[:preset]",
        flag_values=fv,
        lock_config=True,
        sys_argv=_normalize(argv),
    )


# What each command does, with examples: its `--help`.
HELP = {
    "train": (
        "Train with the method the config names (sft, dpo, rm, grpo, ppo); resumes from the "
        "workdir's latest checkpoint. Override any config field with --config.a.b=value.",
        [
            "posttrain train --config=configs/sft.py:tiny --workdir=runs/sft_tiny",
            "posttrain train --config=configs/grpo.py:tiny --workdir=runs/grpo "
            "--config.train.steps=50 --config.rollout.num_generations=4",
        ],
    ),
    "export": (
        "Write a run's checkpoint as a Hugging Face directory (config.json + safetensors).",
        ["posttrain export --workdir=runs/sft_tiny --out=runs/sft_tiny/hf --dtype=bfloat16"],
    ),
    "generate": (
        "Sample from an HF model directory or a training workdir: one streamed prompt, or a "
        "JSONL of prompts in batch.",
        [
            'posttrain generate --model=runs/sft_tiny --chat --prompt="What is 12 + 30?"',
            "posttrain generate --model=HF_DIR --prompts-file=prompts.jsonl --out=out.jsonl --n=4 "
            "--temperature=1.0",
        ],
    ),
    "compile": (
        "AOT-compile the configured method's train step for a TPU slice from this host and "
        "report per-chip memory, FLOPs and whether it fits (exit code 1 if not).",
        [
            "posttrain compile --config=configs/sft.py:kimi_k2_1t --topology=v5p-1024",
            "posttrain compile --config=configs/grpo.py:qwen3_8b_v5p --topology=v5p-64 "
            "--find-smallest",
        ],
    ),
    "demo": (
        "SFT, DPO and GRPO of a tiny model on a bundled arithmetic task, on CPU (~7 minutes).",
        ["posttrain demo --workdir=runs/demo"],
    ),
    "eval": (
        "Evaluate every checkpoint of a run (or one --step, or an HF model directory) on a "
        "suite's general (held-out loss), target (accuracy by verifier, pass@k, preferences) "
        "and safety (refusal / compliance) tasks; writes <workdir>/eval/metrics.jsonl, "
        "table.md and table.csv, one row per checkpoint. See docs/eval.md.",
        [
            "posttrain eval --workdir=runs/demo/sft --config=configs/eval.py:demo",
            "posttrain eval --model=HF_DIR --config=configs/eval.py:template "
            "--config.target.arithmetic.max_examples=100",
        ],
    ),
    "sweep": (
        "Run every trial of a sweep file (grid or random search over config keys, once per "
        "seed), each in DIR/<trial>; print and write DIR/summary.csv. Re-running skips "
        "finished trials and resumes the others. See docs/sweeps.md.",
        [
            "posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/lr_seeds",
            "posttrain sweep --config=configs/sweeps/sft_lr_seeds.py --workdir=runs/lr_seeds "
            "--dry-run",
        ],
    ),
}


def _help(argv: list[str], values) -> str:
    command = argv[0].split()[-1]
    text, examples = HELP.get(command, ("", []))
    lines = [f"usage: {argv[0]} [flags]", "", text, "", "examples:"]
    lines += [f"  {e}" for e in examples] + ["", "flags:"]
    for module, defined in values.flags_by_module_dict().items():
        if module.startswith("absl"):
            continue  # --flagfile, --undefok
        for flag in defined:
            default = "" if flag.default in (None, "") else f" (default: {flag.default})"
            lines.append(f"  --{flag.name}: {flag.help}{default}")
    return "\n".join(lines)


def _config_key_error(argv: list[str]) -> str:
    """Which --config.a.b override names no key of the config file, and the nearest key."""
    import difflib

    from posttrain.config import load_config_file

    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    overrides = [a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")]
    try:
        keys = _dotted_keys(load_config_file(spec))
    except Exception:  # the file itself is broken: its own error is clearer
        return f"{overrides} names a key the config does not have"
    for key in overrides:
        if key not in keys:
            near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
            hint = f"; did you mean --config.{near[0]}?" if near else ""
            return f"--config.{key}: {spec} has no key {key!r}{hint}"
    return f"{overrides} names a key the config does not have"


def _dotted_keys(config, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in config.items():
        keys.add(prefix + name)
        if hasattr(value, "items"):
            keys |= _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _parse(argv: list[str], define) -> object:
    """Defines the command's absl flags with `define(flags)` and parses `argv` into them;
    `--help` prints the command's help and exits."""
    from absl import flags

    values = flags.FlagValues()
    define(flags, values)
    argv = _normalize(argv)
    if any(a in ("--help", "-h", "--helpfull") for a in argv[1:]):
        print(_help(argv, values))
        raise SystemExit(0)
    try:
        values(argv)
    except flags.Error as e:
        raise SystemExit(f"{argv[0]}: {e}") from None
    except (KeyError, AttributeError):  # a --config.a.b override naming no config key
        raise SystemExit(f"{argv[0]}: {_config_key_error(argv)}") from None
    return values


# Collective errors that mean a peer process is gone (gloo on CPU, NCCL on GPU, JAX's
# coordination service everywhere).
_LOST_PEER = (
    "Gloo", "Connection reset", "NCCL", "coordination service", "heartbeat", "UNAVAILABLE",
)  # fmt: skip


def _define_distributed(flags, fv) -> None:
    flags.DEFINE_string(
        "coordinator", "", "multi-process: host:port of process 0 (TPU VMs, Slurm and Open MPI "
        "are detected without it); env POSTTRAIN_COORDINATOR", flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "num_processes", 0, "multi-process: number of processes; env POSTTRAIN_NUM_PROCESSES",
        flag_values=fv,
    )  # fmt: skip
    flags.DEFINE_integer(
        "process_id", -1, "multi-process: this process's id; env POSTTRAIN_PROCESS_ID",
        flag_values=fv,
    )  # fmt: skip


def _join(fv) -> bool:
    """Joins the multi-process run (no-op alone); True when there are several processes."""
    from posttrain.parallel import DistributedConfig, DistributedError, initialize

    try:
        several = initialize(
            DistributedConfig.from_env(
                coordinator=fv.coordinator, num_processes=fv.num_processes,
                process_id=fv.process_id,
            )
        )  # fmt: skip
    except DistributedError as e:
        raise SystemExit(f"posttrain: {e}") from None
    if several:
        import logging

        import jax

        if jax.process_index() > 0:  # one log for the run: process 0's (warnings from all)
            logging.getLogger("posttrain").setLevel(logging.WARNING)
    return several


def _train(argv: list[str]) -> int:
    def define(flags, fv):
        _config_flag(fv, argv)
        flags.DEFINE_string(
            "workdir", None, "output directory (checkpoints, metrics)", flag_values=fv
        )
        _define_distributed(flags, fv)

    fv = _parse(argv, define)
    if fv.config is None or not fv.workdir:
        raise SystemExit(
            "posttrain train: --config=configs/<method>.py[:preset] and --workdir=DIR are required"
        )
    several = _join(fv)
    from posttrain.train.drivers import run_from_config

    try:
        summary = run_from_config(fv.config, fv.workdir)
    except BaseException:
        if not several:
            raise
        # The other processes wait for this one in their next collective; leave at once
        # (JAX's heartbeat and their watchdogs stop them) rather than hang in shutdown.
        import traceback

        import jax

        traceback.print_exc()
        error, where = sys.exc_info()[1], f"process {jax.process_index()} of {jax.process_count()}"
        if isinstance(error, jax.errors.JaxRuntimeError) and any(
            k in str(error) for k in _LOST_PEER
        ):
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
    print(f"finished at step {summary['final_step']} ({summary['stopped']}); workdir: {fv.workdir}")
    return 0


def _export(argv: list[str]) -> int:
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

    fv = _parse(argv, define)
    if not fv.workdir or not fv.out:
        raise SystemExit("posttrain export: --workdir=DIR and --out=HF_DIR are required")
    from posttrain.models import to_hf
    from posttrain.train import export_peft, load_checkpoint_model

    if not fv.merge_lora:
        export_peft(fv.workdir, fv.out, fv.step)
        print(f"wrote the LoRA adapters (PEFT layout) to {fv.out}")
        return 0
    model = load_checkpoint_model(fv.workdir, fv.step)
    to_hf(model, fv.out, dtype=fv.dtype)
    print(f"wrote {fv.out}")
    return 0


def _generate(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("model", None, "HF model directory or training workdir", flag_values=fv)
        flags.DEFINE_string("prompt", None, "prompt text (streamed answer)", flag_values=fv)
        flags.DEFINE_string("prompts_file", None, "JSONL of prompts (batch mode)", flag_values=fv)
        flags.DEFINE_string("out", None, "batch-mode output JSONL", flag_values=fv)
        flags.DEFINE_bool(
            "chat", False, "wrap the prompt as a user turn of the chat template", flag_values=fv
        )
        flags.DEFINE_integer("max_new_tokens", 128, "tokens to generate", flag_values=fv)
        flags.DEFINE_float("temperature", 0.0, "0 is greedy", flag_values=fv)
        flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", flag_values=fv)
        flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0: all)", flag_values=fv)
        flags.DEFINE_integer("n", 1, "samples per prompt (batch mode)", flag_values=fv)
        flags.DEFINE_integer("seed", 0, "sampling seed", flag_values=fv)

    fv = _parse(argv, define)
    if not fv.model or not (fv.prompt or fv.prompts_file):
        raise SystemExit(
            "posttrain generate: --model and one of --prompt / --prompts-file are required"
        )
    from posttrain.sampling._run import run_generate

    run_generate(
        fv.model,
        prompt=fv.prompt,
        prompts_file=fv.prompts_file,
        out=fv.out,
        chat=fv.chat,
        max_new_tokens=fv.max_new_tokens,
        temperature=fv.temperature,
        top_p=fv.top_p,
        top_k=fv.top_k,
        n=fv.n,
        seed=fv.seed,
    )
    return 0


def _compile(argv: list[str]) -> int:
    def define(flags, fv):
        _config_flag(fv, argv)
        flags.DEFINE_string("topology", None, "TPU slice, e.g. v5p-1024, v6e-256", flag_values=fv)
        flags.DEFINE_integer("num_slices", 1, "slices joined over DCN", flag_values=fv)
        flags.DEFINE_bool(
            "find_smallest", False, "also search the smallest slice it fits on", flag_values=fv
        )

    fv = _parse(argv, define)
    if fv.config is None or not fv.topology:
        raise SystemExit(
            "posttrain compile: --config=configs/<method>.py:preset and --topology=v5p-1024 "
            "are required"
        )
    from posttrain.aot import compile_plan, smallest_fit, suggestion

    report = compile_plan(fv.config, fv.topology, num_slices=fv.num_slices)
    print("\n".join(report.lines()))
    if fv.find_smallest:
        generation = fv.topology.split("-")[0]
        name, _ = smallest_fit(fv.config, generation)
        print(f"smallest {generation} slice it fits on: {name or 'none up to 8192 chips'}")
    if report.fits:
        print("fits")
        return 0
    print(f"does not fit: {suggestion(report)}")
    return 1


def _demo(argv: list[str]) -> int:
    def define(flags, fv):
        flags.DEFINE_string("workdir", "runs/demo", "where the demo writes", flag_values=fv)

    fv = _parse(argv, define)
    from posttrain.demo import run_demo

    run_demo(fv.workdir)
    return 0


def _eval(argv: list[str]) -> int:
    from posttrain.eval import cli

    return cli(argv)


def _sweep(argv: list[str]) -> int:
    from posttrain.sweep import cli

    return cli(argv)


_COMMANDS = {
    "train": _train,
    "export": _export,
    "generate": _generate,
    "eval": _eval,
    "compile": _compile,
    "sweep": _sweep,
    "demo": _demo,
}


def _skip_absent_tpu() -> None:
    """With libtpu installed (the `tpu`/`dev` extras) but no TPU attached, JAX's TPU probe prints
    pages of warnings; a machine with no accelerator device files at all runs on the CPU."""
    devices = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    if "JAX_PLATFORMS" not in os.environ and not any(glob.glob(d) for d in devices):
        os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _skip_absent_tpu()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in _COMMANDS:
        return _COMMANDS[command]([f"posttrain {command}", *rest])
    if command in _PENDING:
        print(
            f"posttrain {command}: not available yet; it arrives with {_PENDING[command]}.",
            file=sys.stderr,
        )
        return 2
    import difflib

    near = difflib.get_close_matches(command, [*_COMMANDS, *_PENDING], n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    print(f"posttrain: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
