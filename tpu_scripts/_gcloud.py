"""The gcloud commands this tool runs, and the runner that prints (--dry-run) or runs them.

A TPU here is either one slice (a TPU VM node, reached with `gcloud compute tpus tpu-vm ...`) or
a multislice queued resource of N slices (nodes NAME-0 ... NAME-<N-1>, reached together with
`gcloud compute tpus queued-resources ssh/scp ... --node=all`).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import NamedTuple

GCLOUD = ("gcloud", "compute", "tpus")
# What gcloud prints when `describe` finds nothing ("NOT_FOUND: Resource ... was not found").
_ABSENT_MARKERS = ("not_found", "not found", "404")


class Target(NamedTuple):
    name: str
    zone: str
    project: str | None
    num_slices: int = 1  # > 1: a multislice queued resource

    @property
    def multislice(self) -> bool:
        return self.num_slices > 1

    def command(self, group: str, verb: str, *positional: str) -> list:
        """`gcloud compute tpus <group> <verb> <positional...> --zone=Z [--project=P]`."""
        location = [f"--zone={self.zone}"] + ([f"--project={self.project}"] if self.project else [])
        return [*GCLOUD, group, verb, *positional, *location]

    def on_workers(self, verb: str, *positional: str, worker="all", node="all") -> list:
        """An ssh/scp command reaching `worker` (of every slice, or of slice `node`)."""
        if self.multislice:
            return self.command("queued-resources", verb, *positional) + [
                f"--node={node}",
                f"--worker={worker}",
            ]
        return self.command("tpu-vm", verb, *positional) + [f"--worker={worker}"]

    def ssh(self, script: str | None, worker="all", node="all") -> list:
        command = [f"--command={script}"] if script is not None else []
        return self.on_workers("ssh", self.name, worker=worker, node=node) + command

    def scp(self, local: str, remote: str, recurse: bool = False) -> list:
        flags = ["--recurse"] if recurse else []
        return self.on_workers("scp", local, f"{self.name}:{remote}") + flags


class GcloudError(Exception):
    """A gcloud command that exited non-zero; `code` is its exit status."""

    def __init__(self, argv: list, code: int, detail: str = ""):
        self.code = code
        message = f"gcloud exited with code {code}: {shlex.join(argv)}"
        super().__init__(message + (f"\n{detail}" if detail else ""))


class Runner:
    """Runs gcloud commands in order, stopping at the first failure; with `dry_run`, prints each
    command (one per line, shell-quoted) instead and runs nothing."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def run(self, argv: list) -> None:
        if self.dry_run:
            print(shlex.join(argv), flush=True)
            return
        print(f"+ {shlex.join(argv)}", file=sys.stderr, flush=True)
        code = _call(argv)
        if code != 0:
            raise GcloudError(argv, code)

    def exists(self, argv: list, dry_run_answer: bool) -> bool:
        """Whether the `describe` command `argv` finds the resource (exit 0) or reports it absent.

        Any other failure (no credentials, no permission, no network) is an error, not "absent":
        `delete` must never report a TPU gone that it could not see.
        """
        if self.dry_run:
            print(shlex.join(argv), flush=True)
            return dry_run_answer
        try:
            done = subprocess.run(
                argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        except FileNotFoundError:
            raise SystemExit(_NO_GCLOUD) from None
        if done.returncode == 0:
            return True
        if any(marker in done.stderr.lower() for marker in _ABSENT_MARKERS):
            return False
        raise GcloudError(argv, done.returncode, done.stderr.strip())


_NO_GCLOUD = (
    "error: gcloud is not on PATH; install the Google Cloud CLI "
    "(https://cloud.google.com/sdk/docs/install) and run `gcloud auth login`"
)


def _call(argv: list) -> int:
    try:
        return subprocess.call(argv)
    except FileNotFoundError:
        raise SystemExit(_NO_GCLOUD) from None
    except KeyboardInterrupt:  # e.g. Ctrl-C on `logs --follow`
        return 130
