"""`posttrain <command>`: thin entry points, one module per command. Each parses its flags and
calls a library function that a notebook can call the same way."""

from __future__ import annotations

import difflib
import glob
import logging
import os
import sys
import traceback

from posttrain import errors
from posttrain.cli import compile, data, demo, eval, export, generate, serve, sweep, train
from posttrain.cli._errors import exit_code, message

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
             [--find-smallest] [--remat-sweep])
  sweep      run a grid or random search over config keys
             (--config=configs/sweeps/<name>.py --workdir=DIR [--dry-run])
  demo       the end-to-end demo on a bundled tiny model and task (--workdir=DIR)
  serve      serve a model over the OpenAI HTTP API (--model=HF_DIR_OR_WORKDIR [--port=8000]
             [--preset=throughput|latency])
  data       data tools: `posttrain data --help` lists the verbs (clean, dedup, ...)

--debug (or POSTTRAIN_DEBUG=1) prints the traceback of an error. Exit codes: 0 done, 1 internal
error, 2 user error, 3 watchdog, 4 diverged, 75 preempted and saved: rerun to resume.
"""

_COMMANDS = {
    "train": train.main,
    "export": export.main,
    "generate": generate.main,
    "eval": eval.main,
    "compile": compile.main,
    "sweep": sweep.main,
    "demo": demo.main,
    "serve": serve.main,
    "data": data.main,
}

# Commands whose drivers have not landed yet, with the issue that brings each one.
_PENDING: dict[str, str] = {}


def _skip_absent_tpu() -> None:
    """With libtpu installed (the `tpu`/`dev` extras) but no TPU attached, JAX's TPU probe prints
    pages of warnings; a machine with no accelerator device files at all runs on the CPU."""
    devices = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
    if "JAX_PLATFORMS" not in os.environ and not any(glob.glob(d) for d in devices):
        os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the shell's `posttrain`: our notes only once, not again through a root
        logging.getLogger("posttrain").propagate = False  # handler (absl adds one on its first log)
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("POSTTRAIN_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    _skip_absent_tpu()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in _COMMANDS:
        return _run(f"posttrain {command}", _COMMANDS[command], rest, debug)
    if command in _PENDING:
        print(
            f"posttrain {command}: not available yet; it arrives with {_PENDING[command]}.",
            file=sys.stderr,
        )
        return errors.EXIT_USER
    near = difflib.get_close_matches(command, [*_COMMANDS, *_PENDING], n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    print(f"posttrain: unknown command {command!r}{hint}\n\n{USAGE}", file=sys.stderr)
    return errors.EXIT_USER


class _Stderr(logging.Handler):
    """Writes each record to whatever `sys.stderr` is at the time (a test may have replaced
    it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 -- logging's own policy for a failed write
            self.handleError(record)


def _show_progress_notes() -> None:
    """The library's INFO notes (resumed from a checkpoint, joined a multi-process run, ...)
    go to stderr as "posttrain: ..." lines; Python's default shows only warnings."""
    logger = logging.getLogger("posttrain")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("posttrain: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _run(name: str, command, rest: list[str], debug: bool) -> int:
    """Runs a command; an error the user can fix is one line and exit code 2 (see errors.py)."""
    _show_progress_notes()
    try:
        return command([name, *rest])
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code = exit_code(e)
        if code == errors.EXIT_BUG or debug:
            traceback.print_exc()
        if code != errors.EXIT_BUG:
            print(f"{name}: {message(e)}", file=sys.stderr)
            if not debug:
                print("(--debug shows the traceback)", file=sys.stderr)
        return code
