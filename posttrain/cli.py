"""`posttrain <command>`: a thin entry point. Each command parses its flags and calls a library
function that a notebook can call the same way."""

from __future__ import annotations

import sys

USAGE = """usage: posttrain <command> [flags]

commands:
  train      train a model (--config=configs/<method>.py[:preset] --workdir=DIR)
  generate   sample from a model
  eval       evaluate a checkpoint
  export     write a checkpoint as a Hugging Face directory
  compile    AOT-compile a train step for a TPU topology and report memory
  sweep      run a grid or random search over config keys
  demo       the end-to-end demo on a bundled tiny model and task
"""

# Commands whose drivers have not landed yet, with the issue that brings each one.
_PENDING = {
    "train": "SFT (issue #3)",
    "generate": "the generation engine (issue #5)",
    "eval": "the evaluation harness (issue #10)",
    "export": "SFT checkpoints (issue #3)",
    "compile": "AOT compilation (issue #8)",
    "sweep": "sweeps (issue #10)",
}

DEMO_PLAN = """posttrain demo: the end-to-end job on a bundled tiny model (CPU, minutes).

What it will run once the training drivers land:
  1. SFT      a tiny model learns the bundled task           (issue #3)
  2. DPO      preference pairs labelled by the verifier        (issue #6)
  3. GRPO     RL with verifiable rewards on the same task      (issue #7)
Each stage prints accuracy before and after. Today the model, HF import/export and
sharding are in place: `make test` exercises them.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command = argv[0]
    if command == "demo":
        print(DEMO_PLAN)
        return 0
    if command in _PENDING:
        print(
            f"posttrain {command}: not available yet; it arrives with {_PENDING[command]}.",
            file=sys.stderr,
        )
        return 2
    print(f"posttrain: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
