#!/usr/bin/env python3
"""Create Cloud TPU VMs and pods, install posttrain on every worker, launch and watch runs.

    python3 tpu_scripts/tpu.py create my-tpu --accelerator-type=v5p-64 --zone=ZONE
    python3 tpu_scripts/tpu.py setup my-tpu --zone=ZONE --git=https://github.com/ORG/posttrain
    python3 tpu_scripts/tpu.py launch my-tpu --zone=ZONE -- \\
        posttrain train --config=configs/sft.py:llama3_8b_v5p --workdir=gs://BUCKET/run
    python3 tpu_scripts/tpu.py logs my-tpu --zone=ZONE --follow

A thin wrapper over `gcloud compute tpus tpu-vm` and `gcloud compute tpus queued-resources`:
standard library only, so it runs on a laptop with gcloud and without posttrain. `--dry-run`
prints the gcloud commands instead of running them. See tpu_scripts/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _cli  # noqa: E402


def main(argv: list | None = None) -> int:
    return _cli.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
