"""The subcommands and flags of tpu_scripts/tpu.py; every check runs before any gcloud call."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

import _accelerators
import _remote
from _gcloud import GcloudError, Runner, Target

ZONE_ENV = "POSTTRAIN_TPU_ZONE"  # default for --zone
PROJECT_ENV = "POSTTRAIN_TPU_PROJECT"  # default for --project (else gcloud's core/project)
REPO = Path(__file__).resolve().parent.parent
# GCP resource names (https://cloud.google.com/compute/docs/naming-resources): 1-63 characters,
# lowercase letters, digits and hyphens, a letter first and no hyphen last. The TPU API's node-id
# pattern is looser, but TPU names also name the worker VMs, where only this form is safe.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RUN = re.compile(r"[A-Za-z0-9_.-]+")
_ARTIFACT = re.compile(r"[A-Za-z0-9_.+-]+\.(whl|tar\.gz)")
_WORKER = re.compile(r"all|\d+")


class UsageError(Exception):
    """A bad flag or argument: reported before any gcloud command runs."""


def _create(args, target: Target, runner: Runner, tail: list) -> None:
    try:
        accelerator = _accelerators.parse(args.accelerator_type)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.spot and args.reserved:
        raise UsageError(
            "--spot and --reserved exclude each other: --spot asks for preemptible spare "
            "capacity, --reserved for your project's reservation; pass one"
        )
    queued = args.queued or target.multislice
    version = args.version or accelerator.runtime
    if queued:
        describe = target.command("queued-resources", "describe", target.name)
        nodes = (
            [f"--node-count={target.num_slices}", f"--node-prefix={target.name}"]
            if target.multislice
            else [f"--node-id={target.name}"]
        )
        create = target.command("queued-resources", "create", target.name) + [
            f"--accelerator-type={accelerator.gcloud_type}",
            f"--runtime-version={version}",
            *nodes,
        ]
    else:
        describe = target.command("tpu-vm", "describe", target.name)
        create = target.command("tpu-vm", "create", target.name) + [
            f"--accelerator-type={accelerator.gcloud_type}",
            f"--version={version}",
        ]
    create += ["--spot"] * args.spot + ["--reserved"] * args.reserved + args.gcloud_flag
    kind = "queued resource" if queued else "TPU"
    if runner.exists(describe, dry_run_answer=False):
        _say(f"{kind} {target.name} already exists in {target.zone}; not creating it")
        return
    runner.run(create)
    if queued and not runner.dry_run:
        _say(
            f"queued {target.name}; it is ready when `python3 tpu_scripts/tpu.py status "
            f"{target.name} --queued --zone={target.zone}` shows state ACTIVE"
        )


def _status(args, target: Target, runner: Runner, tail: list) -> None:
    group = "queued-resources" if args.queued or target.multislice else "tpu-vm"
    runner.run(target.command(group, "describe", target.name))


def _delete(args, target: Target, runner: Runner, tail: list) -> None:
    queued = args.queued or target.multislice
    group = "queued-resources" if queued else "tpu-vm"
    if not runner.exists(target.command(group, "describe", target.name), dry_run_answer=True):
        _say(
            f"{'queued resource' if queued else 'TPU'} {target.name} does not exist in "
            f"{target.zone}; nothing to delete"
        )
        return
    force = ["--force"] if queued else []  # --force: delete the queued resource's nodes too
    runner.run(target.command(group, "delete", target.name) + force + ["--quiet"])


def _setup(args, target: Target, runner: Runner, tail: list) -> None:
    if bool(args.git) == bool(args.wheel):
        raise UsageError("setup installs from exactly one of --git=URL [--ref=REF] or --wheel=PATH")
    if args.ref and not args.git:
        raise UsageError("--ref names a git branch, tag or commit and needs --git=URL")
    if args.wheel:
        path = Path(args.wheel).expanduser()
        if not path.is_file():
            raise UsageError(f"--wheel={args.wheel}: no such file (`python -m build` makes one)")
        if not _ARTIFACT.fullmatch(path.name):
            raise UsageError(f"--wheel={args.wheel}: expected a .whl or .tar.gz file name")
        runner.run(target.scp(str(path), ""))  # to each worker's home directory
        requirement = f'"posttrain[tpu] @ file://$HOME/{path.name}"'
    else:
        url = args.git if args.git.startswith("git+") else f"git+{args.git}"
        url += f"@{args.ref}" if args.ref else ""
        if re.search(r"[\s'\"]", url):
            raise UsageError(f"--git/--ref: {url!r} has a space or quote")
        requirement = shlex.quote(f"posttrain[tpu] @ {url}")
    if not re.fullmatch(r"\d+(\.\d+)*", args.python):
        raise UsageError(f"--python={args.python}: expected a version such as 3.12")
    runner.run(target.ssh(_remote.setup(requirement, args.python)))


def _launch(args, target: Target, runner: Runner, tail: list) -> None:
    if not tail:
        raise UsageError(
            "launch runs the command after --, e.g. launch NAME -- posttrain train "
            "--config=configs/sft.py:llama3_8b_v5p --workdir=gs://BUCKET/run"
        )
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise UsageError(f"--env {item!r}: expected KEY=VALUE with KEY a shell variable name")
        env[key] = value
    workdir = _flag_value(tail, "--workdir")
    run = args.run or _run_name(workdir)
    if not _RUN.fullmatch(run):
        raise UsageError(f"--run={run}: use letters, digits, '.', '_' and '-'")
    configs = None
    if not args.no_configs:
        configs = Path(args.configs).expanduser().resolve() if args.configs else REPO / "configs"
        if not configs.is_dir():
            raise UsageError(f"--configs={configs}: not a directory (or pass --no-configs)")
    if workdir is not None and not workdir.startswith("gs://"):
        _say(
            f"warning: --workdir={workdir} is not a gs:// path: on a multi-host slice every "
            "worker must write checkpoints to the same shared directory"
        )
    if configs is not None:  # so that --config=configs/... resolves on the workers
        runner.run(target.scp(str(configs), f"{_remote.RUN_DIR}/", recurse=True))
    runner.run(target.ssh(_remote.launch(tail, env, run)))
    if not runner.dry_run:
        _say(
            f"launched {run}; follow it with `python3 tpu_scripts/tpu.py logs {target.name} "
            f"--zone={target.zone} --follow`"
        )


def _logs(args, target: Target, runner: Runner, tail: list) -> None:
    if not _RUN.fullmatch(args.run):
        raise UsageError(f"--run={args.run}: use letters, digits, '.', '_' and '-'")
    if args.lines < 1:
        raise UsageError(f"--lines={args.lines}: must be at least 1")
    worker, node = _worker_and_node(args, target)
    runner.run(target.ssh(_remote.logs(args.run, args.lines, args.follow), worker, node))


def _ssh(args, target: Target, runner: Runner, tail: list) -> None:
    worker, node = _worker_and_node(args, target)
    if not tail and "all" in (worker, node):
        raise UsageError(
            "an interactive ssh reaches one worker; --worker/--slice=all need a command after --"
        )
    runner.run(target.ssh(" ".join(tail) if tail else None, worker, node))


def _stop(args, target: Target, runner: Runner, tail: list) -> None:
    runner.run(target.ssh(_remote.stop(args.force)))


def _worker_and_node(args, target: Target):
    if not _WORKER.fullmatch(args.worker):
        raise UsageError(f"--worker={args.worker}: expected a 0-based worker index or 'all'")
    if args.slice is not None and not target.multislice:
        raise UsageError("--slice picks a slice of a multislice TPU: pass --num-slices too")
    node = args.slice if args.slice is not None else "0"
    if not _WORKER.fullmatch(node) or (node.isdigit() and int(node) >= target.num_slices):
        raise UsageError(f"--slice={node}: expected 0..{target.num_slices - 1} or 'all'")
    return args.worker, node


def _flag_value(command: list, flag: str) -> str | None:
    """The value of `flag` in a command line (`--flag=v` or `--flag v`), if present."""
    for i, arg in enumerate(command):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
    return None


def _run_name(workdir: str | None) -> str:
    """The run's log name: the workdir's last path component (gs://b/sft-8b -> sft-8b)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", (workdir or "").rstrip("/").rsplit("/", 1)[-1])
    return name.strip(".-") or "run"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    def common(p, default):
        p.add_argument("--zone", default=default, help=f"TPU zone (default: ${ZONE_ENV})")
        p.add_argument(
            "--project",
            default=default,
            help=f"GCP project (default: ${PROJECT_ENV}, else gcloud's core/project)",
        )
        p.add_argument(
            "--dry-run",
            action="store_true",
            default=default or False,
            help="print the gcloud commands, one per line, and run nothing",
        )

    def slices(p):
        p.add_argument(
            "--num-slices",
            type=int,
            default=1,
            help="slices of a multislice queued resource (nodes NAME-0..NAME-<N-1>)",
        )

    def worker(p, default):
        p.add_argument("--worker", default=default, help="0-based worker index, or 'all'")
        p.add_argument("--slice", help="slice of a multislice TPU (default 0), or 'all'")

    parser = argparse.ArgumentParser(
        prog="tpu.py",
        description="Cloud TPU VMs and pods for posttrain (wraps gcloud).",
        epilog="Run `tpu.py COMMAND --help` for a command's flags; see tpu_scripts/README.md.",
    )
    common(parser, None)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")

    def add(name, handler, help):
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("name", metavar="NAME", help="TPU (or queued resource) name")
        common(p, argparse.SUPPRESS)
        slices(p)
        p.set_defaults(handler=handler)
        return p

    p = add("create", _create, "create a TPU VM slice (or queue one; or a multislice)")
    p.add_argument("--accelerator-type", required=True, help="e.g. v5p-128, v6e-16, v5e-16")
    p.add_argument("--version", help="TPU software version (default: the generation's runtime)")
    p.add_argument("--spot", action="store_true", help="spot (preemptible) capacity")
    p.add_argument("--reserved", action="store_true", help="your project's reserved capacity")
    p.add_argument("--queued", action="store_true", help="create through a queued resource")
    p.add_argument(
        "--gcloud-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra gcloud create flag, e.g. --gcloud-flag=--internal-ips",
    )
    p = add("status", _status, "describe the TPU (or the queued resource with --queued)")
    p.add_argument("--queued", action="store_true", help="describe the queued resource")
    p = add("setup", _setup, "install posttrain[tpu] on every worker (safe to re-run)")
    p.add_argument("--git", help="git URL to pip-install, e.g. https://github.com/ORG/posttrain")
    p.add_argument("--ref", help="git branch, tag or commit (with --git)")
    p.add_argument("--wheel", help="local wheel or sdist to copy to the workers and install")
    p.add_argument("--python", default="3.12", help="Python version of the workers' venv")
    p = add("launch", _launch, "run `-- COMMAND...` on every worker in the background")
    p.add_argument("--run", help="log name (default: the --workdir's last component)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the run (repeatable)",
    )
    p.add_argument("--configs", help="config directory to copy (default: the repo's configs/)")
    p.add_argument("--no-configs", action="store_true", help="copy no config directory")
    p = add("logs", _logs, "print (or --follow) a worker's log of the newest (or --run) run")
    worker(p, "0")
    p.add_argument("--run", default="latest", help="run name (default: the newest launch)")
    p.add_argument("--lines", type=int, default=100, help="lines of the log to print")
    p.add_argument("--follow", action="store_true", help="keep printing as the log grows")
    p = add("ssh", _ssh, "ssh into a worker, or run `-- COMMAND` on workers")
    worker(p, "0")
    p = add("stop", _stop, "stop the run on every worker (SIGTERM: the train loop checkpoints)")
    p.add_argument("--force", action="store_true", help="SIGKILL instead: no checkpoint")
    p = add("delete", _delete, "delete the TPU (with --queued: the queued resource and its nodes)")
    p.add_argument("--queued", action="store_true", help="delete the queued resource")
    return parser


def main(argv: list) -> int:
    """Parses `argv` (after the program name) and runs the subcommand; returns the exit code."""
    tail = []
    if "--" in argv:
        argv, tail = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = _parser().parse_args(argv)
    try:
        if tail and args.subcommand not in ("launch", "ssh"):
            raise UsageError(f"{args.subcommand} takes no command after --")
        target = _target(args)
        args.handler(args, target, Runner(args.dry_run), tail)
    except UsageError as e:
        print(f"tpu.py {args.subcommand}: error: {e}", file=sys.stderr)
        return 2
    except GcloudError as e:
        if e.code != 130:  # 130: interrupted (Ctrl-C), e.g. ending `logs --follow`
            print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


def _target(args) -> Target:
    """The TPU the command acts on, with its name, zone and slice count checked."""
    zone = args.zone or os.environ.get(ZONE_ENV)
    if not zone:
        raise UsageError(
            f"no zone: pass --zone=ZONE or set {ZONE_ENV} (`gcloud compute tpus locations list` "
            "lists the TPU zones)"
        )
    if not _NAME.fullmatch(args.name):
        raise UsageError(
            f"bad name {args.name!r}: GCP resource names are 1-63 lowercase letters, digits and "
            "hyphens, starting with a letter and not ending with a hyphen (e.g. my-v5p-64)"
        )
    if args.num_slices < 1:
        raise UsageError(f"--num-slices={args.num_slices}: must be at least 1")
    last_node = f"{args.name}-{args.num_slices - 1}"
    if args.num_slices > 1 and len(last_node) > 63:
        raise UsageError(f"bad name {args.name!r}: slice name {last_node} passes 63 characters")
    return Target(args.name, zone, args.project or os.environ.get(PROJECT_ENV), args.num_slices)
