"""The shell commands that run on each TPU VM worker through `gcloud ... ssh --command`.

Each is one line of POSIX sh (so `--dry-run` prints one gcloud command per line), and every path
is under $HOME, so running a command twice is safe.
"""

from __future__ import annotations

import shlex

VENV = "posttrain-venv"  # under $HOME: the Python environment setup installs posttrain into
RUN_DIR = "posttrain-run"  # under $HOME: launch copies configs/ here and starts the run from it
LOG_DIR = "posttrain-logs"  # under $HOME: <run>.log per worker, latest.log links the newest
# Matches the command line of the `posttrain` entry point (`.../bin/python .../bin/posttrain
# train ...`); the brackets keep it from matching the shell that runs pgrep/pkill.
PROCESS = "[b]in/posttrain"
# Environment every launch sets. PYTHONUNBUFFERED: stdout goes to a log file, where Python would
# otherwise buffer it in blocks and `logs` would show nothing for minutes.
DEFAULT_ENV = {"PYTHONUNBUFFERED": "1"}


def setup(requirement: str, python: str) -> str:
    """Installs `requirement` (a quoted pip requirement) into $HOME/posttrain-venv.

    uv makes a venv with a Python posttrain supports (>= 3.11) whatever the image's python3 is;
    the venv is created once, and only posttrain itself is reinstalled on a re-run.
    """
    venv_python = f'"$HOME/{VENV}/bin/python"'
    return "; ".join(
        [
            "set -eu",
            f'mkdir -p "$HOME/{RUN_DIR}" "$HOME/{LOG_DIR}"',
            "python3 -m pip install --user --quiet --upgrade uv",
            'export PATH="$HOME/.local/bin:$PATH"',
            f'[ -x {venv_python} ] || uv venv --python {shlex.quote(python)} "$HOME/{VENV}"',
            f"uv pip install --python {venv_python} --reinstall-package posttrain {requirement}",
            f'"$HOME/{VENV}/bin/posttrain" --help > /dev/null',
            'echo "posttrain is installed on $(hostname)"',
        ]
    )


def launch(command: list, env: dict, run: str) -> str:
    """Starts `command` in the background (nohup) with `env`, output to ~/posttrain-logs/<run>.log;
    refuses while a posttrain process is running (a TPU is opened by one process at a time)."""
    log = f'"$HOME/{LOG_DIR}/{run}.log"'
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**DEFAULT_ENV, **env}.items())
    return (
        "; ".join(
            [
                "set -eu",
                f'mkdir -p "$HOME/{LOG_DIR}"',
                f'cd "$HOME/{RUN_DIR}" || {{ echo "no ~/{RUN_DIR} on $(hostname): run setup '
                'first" >&2; exit 1; }',
                f"if pgrep -f '{PROCESS}' > /dev/null; then echo \"posttrain is already running "
                'on $(hostname): stop it first" >&2; exit 1; fi',
                f'export PATH="$HOME/{VENV}/bin:$PATH"',
            ]
        )
        + f"; nohup env {assignments} {shlex.join(command)} > {log} 2>&1 < /dev/null & "
        + f'ln -sfn {run}.log "$HOME/{LOG_DIR}/latest.log"; '
        + f'echo "started {run} on $(hostname), log ~/{LOG_DIR}/{run}.log"'
    )


def logs(run: str, lines: int, follow: bool) -> str:
    """Prints the last `lines` of the run's log (`latest` = the newest launch), or follows it."""
    log = f'"$HOME/{LOG_DIR}/{run}.log"'
    follow_flag = " -F" if follow else ""  # -F: keep following when a relaunch relinks latest
    return (
        f'[ -e {log} ] || {{ echo "no ~/{LOG_DIR}/{run}.log on $(hostname): nothing launched '
        'yet?" >&2; exit 1; }; '
        f"tail -n {lines}{follow_flag} {log}"
    )


def stop(force: bool) -> str:
    """Signals every posttrain process: SIGTERM (the loop checkpoints, then exits) or SIGKILL."""
    signal = "KILL" if force else "TERM"
    return (
        f"if pkill -{signal} -f '{PROCESS}'; then echo \"sent SIG{signal} to posttrain on "
        '$(hostname)"; else echo "no posttrain running on $(hostname)"; fi'
    )
