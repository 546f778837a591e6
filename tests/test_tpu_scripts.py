"""tpu_scripts/tpu.py against a fake `gcloud` that records every invocation, and its remote
shell commands run locally in a scratch $HOME."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

TPU = Path(__file__).resolve().parent.parent / "tpu_scripts" / "tpu.py"
CONFIGS = str(TPU.parent.parent / "configs")
ZONE = "us-east5-a"
TPU_VM = ["gcloud", "compute", "tpus", "tpu-vm"]
QR = ["gcloud", "compute", "tpus", "queued-resources"]
TRAIN = [
    "posttrain",
    "train",
    "--config=configs/sft.py:llama3_8b_v5p",
    "--workdir=gs://bucket/sft-8b",
]

# Appends its argv as one JSON line to $FAKE_GCLOUD_LOG; `describe` answers per
# $FAKE_GCLOUD_DESCRIBE (exists / absent / error), everything else exits $FAKE_GCLOUD_RC.
FAKE_GCLOUD = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(["gcloud", *args]) + "\\n")
if "describe" in args:
    answer = os.environ["FAKE_GCLOUD_DESCRIBE"]
    if answer == "exists":
        sys.exit(0)
    if answer == "absent":
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource "
                 "'projects/p/locations/z/nodes/x' was not found")
    sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing "
             "your current auth tokens")
sys.exit(int(os.environ["FAKE_GCLOUD_RC"]))
"""


class FakeGcloud:
    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        exe = self.bin / "gcloud"
        exe.write_text(f"#!{sys.executable}\n{FAKE_GCLOUD}")
        exe.chmod(0o755)
        self.log = tmp_path / "gcloud.jsonl"
        self.log.touch()

    def run(self, *args, describe="absent", rc=0, env=None, path=None):
        """Runs tpu.py with `python3 -S` (no site-packages: the standard library only)."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("POSTTRAIN_TPU_")}
        environ.update(
            PATH=path or f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            FAKE_GCLOUD_LOG=str(self.log),
            FAKE_GCLOUD_DESCRIBE=describe,
            FAKE_GCLOUD_RC=str(rc),
            **(env or {}),
        )
        return subprocess.run(
            [sys.executable, "-S", str(TPU), *args],
            env=environ,
            capture_output=True,
            text=True,
            timeout=60,
        )

    @property
    def calls(self) -> list:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def gcloud(tmp_path):
    return FakeGcloud(tmp_path)


def _command(call: list) -> str:
    """The --command=... of a recorded ssh call."""
    (command,) = [a.split("=", 1)[1] for a in call if a.startswith("--command=")]
    return command


def test_create_checks_then_creates_with_the_generation_runtime(gcloud):
    done = gcloud.run("create", "my-tpu", "--accelerator-type=v5p-128", f"--zone={ZONE}")
    assert done.returncode == 0, done.stderr
    assert gcloud.calls == [
        TPU_VM + ["describe", "my-tpu", f"--zone={ZONE}"],
        TPU_VM
        + [
            "create",
            "my-tpu",
            f"--zone={ZONE}",
            "--accelerator-type=v5p-128",
            "--version=v2-alpha-tpuv5",
        ],
    ]


def test_create_spot_v5e_alias_maps_to_v5litepod(gcloud):
    done = gcloud.run(
        "create", "lite", "--accelerator-type=v5e-16", "--spot", f"--zone={ZONE}", "--project=p1"
    )
    assert done.returncode == 0, done.stderr
    assert gcloud.calls[-1] == TPU_VM + [
        "create",
        "lite",
        f"--zone={ZONE}",
        "--project=p1",
        "--accelerator-type=v5litepod-16",
        "--version=v2-alpha-tpuv5-lite",
        "--spot",
    ]


def test_create_queued_multislice(gcloud):
    done = gcloud.run(
        "create", "ms", "--accelerator-type=v6e-256", "--num-slices=4", "--spot", f"--zone={ZONE}"
    )
    assert done.returncode == 0, done.stderr
    assert gcloud.calls == [
        QR + ["describe", "ms", f"--zone={ZONE}"],
        QR
        + [
            "create",
            "ms",
            f"--zone={ZONE}",
            "--accelerator-type=v6e-256",
            "--runtime-version=v2-alpha-tpuv6e",
            "--node-count=4",
            "--node-prefix=ms",
            "--spot",
        ],
    ]
    assert "ACTIVE" in done.stderr


def test_create_queued_single_slice_reserved_and_extra_flags(gcloud):
    done = gcloud.run(
        "create",
        "q",
        "--accelerator-type=v4-32",
        "--queued",
        "--reserved",
        "--version=tpu-ubuntu2204-base",
        "--gcloud-flag=--internal-ips",
        f"--zone={ZONE}",
    )
    assert done.returncode == 0, done.stderr
    assert gcloud.calls[-1] == QR + [
        "create",
        "q",
        f"--zone={ZONE}",
        "--accelerator-type=v4-32",
        "--runtime-version=tpu-ubuntu2204-base",
        "--node-id=q",
        "--reserved",
        "--internal-ips",
    ]


def test_create_of_an_existing_tpu_only_describes_it(gcloud):
    done = gcloud.run(
        "create", "my-tpu", "--accelerator-type=v6e-8", f"--zone={ZONE}", describe="exists"
    )
    assert done.returncode == 0
    assert gcloud.calls == [TPU_VM + ["describe", "my-tpu", f"--zone={ZONE}"]]
    assert "already exists" in done.stderr


def test_zone_and_project_from_the_environment(gcloud):
    env = {"POSTTRAIN_TPU_ZONE": "europe-west4-a", "POSTTRAIN_TPU_PROJECT": "proj"}
    done = gcloud.run("stop", "my-tpu", env=env)
    assert done.returncode == 0, done.stderr
    assert gcloud.calls[0][:8] == TPU_VM + [
        "ssh",
        "my-tpu",
        "--zone=europe-west4-a",
        "--project=proj",
    ]


def test_setup_from_git_on_every_worker(gcloud):
    done = gcloud.run(
        "setup", "my-tpu", f"--zone={ZONE}", "--git=https://github.com/org/posttrain", "--ref=v1"
    )
    assert done.returncode == 0, done.stderr
    (call,) = gcloud.calls
    assert call[:-1] == TPU_VM + ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=all"]
    command = _command(call)
    assert "uv venv --python 3.12" in command
    assert "'posttrain[tpu] @ git+https://github.com/org/posttrain@v1'" in command
    assert "--reinstall-package posttrain" in command  # re-running reinstalls only posttrain
    assert '[ -x "$HOME/posttrain-venv/bin/python" ] ||' in command  # the venv is made once


def test_setup_from_a_wheel_copies_it_to_every_worker(gcloud, tmp_path):
    wheel = tmp_path / "posttrain-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    done = gcloud.run("setup", "my-tpu", f"--zone={ZONE}", f"--wheel={wheel}")
    assert done.returncode == 0, done.stderr
    scp, ssh = gcloud.calls
    assert scp == TPU_VM + ["scp", str(wheel), "my-tpu:", f"--zone={ZONE}", "--worker=all"]
    assert ssh[:-1] == TPU_VM + ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=all"]
    assert '"posttrain[tpu] @ file://$HOME/posttrain-0.1.0-py3-none-any.whl"' in _command(ssh)


def test_launch_runs_the_command_on_all_workers_with_a_log_per_worker(gcloud):
    done = gcloud.run(
        "launch", "my-tpu", f"--zone={ZONE}", "--env", "XLA_FLAGS=--a --b", "--", *TRAIN
    )
    assert done.returncode == 0, done.stderr
    scp, ssh = gcloud.calls
    assert scp == TPU_VM + [
        "scp",
        CONFIGS,
        "my-tpu:posttrain-run/",
        f"--zone={ZONE}",
        "--worker=all",
        "--recurse",
    ]
    assert ssh[:-1] == TPU_VM + ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=all"]
    command = _command(ssh)
    assert (
        "nohup env PYTHONUNBUFFERED=1 XLA_FLAGS='--a --b' "
        + shlex.join(TRAIN)
        + ' > "$HOME/posttrain-logs/sft-8b.log" 2>&1 < /dev/null &'
    ) in command
    assert 'cd "$HOME/posttrain-run"' in command


def test_launch_on_a_multislice_reaches_every_slice(gcloud):
    done = gcloud.run(
        "launch", "ms", "--num-slices=2", "--no-configs", "--run=r1", f"--zone={ZONE}", "--", *TRAIN
    )
    assert done.returncode == 0, done.stderr
    (ssh,) = gcloud.calls
    assert ssh[:-1] == QR + ["ssh", "ms", f"--zone={ZONE}", "--node=all", "--worker=all"]
    assert '> "$HOME/posttrain-logs/r1.log"' in _command(ssh)


def test_launch_warns_about_a_local_workdir(gcloud):
    done = gcloud.run(
        "launch", "t", f"--zone={ZONE}", "--no-configs", "--", "posttrain", "train",
        "--workdir", "/tmp/run",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "not a gs:// path" in done.stderr
    assert '"$HOME/posttrain-logs/run.log"' in _command(gcloud.calls[0])


def test_logs_stop_and_ssh(gcloud):
    for args in (
        ["logs", "my-tpu", "--worker=2", "--follow"],
        ["stop", "my-tpu"],
        ["ssh", "my-tpu", "--worker=1"],
        ["ssh", "my-tpu", "--worker=all", "--", "ls", "/"],
    ):
        done = gcloud.run(f"--zone={ZONE}", *args)
        assert done.returncode == 0, done.stderr
    logs, stop, interactive, command = gcloud.calls
    log = '"$HOME/posttrain-logs/latest.log"'
    assert logs == TPU_VM + [
        "ssh",
        "my-tpu",
        f"--zone={ZONE}",
        "--worker=2",
        f'--command=[ -e {log} ] || {{ echo "no ~/posttrain-logs/latest.log on $(hostname): '
        f'nothing launched yet?" >&2; exit 1; }}; tail -n 100 -F {log}',
    ]
    assert stop == TPU_VM + [
        "ssh",
        "my-tpu",
        f"--zone={ZONE}",
        "--worker=all",
        "--command=if pkill -TERM -f '[b]in/posttrain'; then echo \"sent SIGTERM to posttrain "
        'on $(hostname)"; else echo "no posttrain running on $(hostname)"; fi',
    ]
    assert interactive == TPU_VM + ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=1"]
    assert command == TPU_VM + ["ssh", "my-tpu", f"--zone={ZONE}", "--worker=all", "--command=ls /"]


def test_logs_of_one_slice_of_a_multislice(gcloud):
    done = gcloud.run("logs", "ms", "--num-slices=4", "--slice=3", "--run=r1", f"--zone={ZONE}")
    assert done.returncode == 0, done.stderr
    (call,) = gcloud.calls
    assert call[:-1] == QR + ["ssh", "ms", f"--zone={ZONE}", "--node=3", "--worker=0"]
    assert _command(call).endswith('tail -n 100 "$HOME/posttrain-logs/r1.log"')


def test_delete_existing_absent_and_queued(gcloud):
    assert gcloud.run("delete", "my-tpu", f"--zone={ZONE}", describe="exists").returncode == 0
    assert gcloud.calls == [
        TPU_VM + ["describe", "my-tpu", f"--zone={ZONE}"],
        TPU_VM + ["delete", "my-tpu", f"--zone={ZONE}", "--quiet"],
    ]
    gcloud.log.write_text("")
    absent = gcloud.run("delete", "my-tpu", f"--zone={ZONE}", describe="absent")
    assert absent.returncode == 0
    assert "nothing to delete" in absent.stderr
    assert gcloud.calls == [TPU_VM + ["describe", "my-tpu", f"--zone={ZONE}"]]
    gcloud.log.write_text("")
    queued = gcloud.run("delete", "q", "--queued", f"--zone={ZONE}", describe="exists")
    assert queued.returncode == 0, queued.stderr
    assert gcloud.calls[-1] == QR + ["delete", "q", f"--zone={ZONE}", "--force", "--quiet"]


def test_a_describe_that_fails_for_another_reason_is_an_error_not_absent(gcloud):
    done = gcloud.run("delete", "my-tpu", f"--zone={ZONE}", describe="error")
    assert done.returncode == 1
    assert "gcloud exited with code 1: gcloud compute tpus tpu-vm describe" in done.stderr
    assert "auth tokens" in done.stderr
    assert len(gcloud.calls) == 1


def test_dry_run_prints_the_commands_and_runs_nothing(gcloud):
    create = gcloud.run(
        "--dry-run", "create", "ms", "--accelerator-type=v5p-64", "--num-slices=2", f"--zone={ZONE}"
    )
    launch = gcloud.run("launch", "my-tpu", f"--zone={ZONE}", "--dry-run", "--", *TRAIN)
    assert create.returncode == launch.returncode == 0, create.stderr + launch.stderr
    assert gcloud.calls == []
    assert [shlex.split(line) for line in create.stdout.splitlines()] == [
        QR + ["describe", "ms", f"--zone={ZONE}"],
        QR
        + [
            "create",
            "ms",
            f"--zone={ZONE}",
            "--accelerator-type=v5p-64",
            "--runtime-version=v2-alpha-tpuv5",
            "--node-count=2",
            "--node-prefix=ms",
        ],
    ]
    scp, ssh = [shlex.split(line) for line in launch.stdout.splitlines()]
    assert scp[:5] == TPU_VM + ["scp"] and ssh[:5] == TPU_VM + ["ssh"]
    assert shlex.join(TRAIN) in _command(ssh)


@pytest.mark.parametrize(
    "args, message",
    [
        (["create", "t", "--accelerator-type=v7x-9"], "unknown accelerator type 'v7x-9'"),
        (["create", "t", "--accelerator-type=v5litepod-2"], "not a v5e size"),
        (["create", "t", "--accelerator-type=v5p-100"], "not a v5p size"),
        (["create", "t", "--accelerator-type=v5p-8", "--spot", "--reserved"], "exclude each other"),
        (["create", "My_TPU", "--accelerator-type=v5p-8"], "bad name 'My_TPU'"),
        (["create", "t-", "--accelerator-type=v5p-8"], "bad name 't-'"),
        (["create", "t" * 62, "--accelerator-type=v5p-8", "--num-slices=2"], "passes 63"),
        (["create", "t", "--accelerator-type=v5p-8", "--num-slices=0"], "at least 1"),
        (["launch", "t"], "launch runs the command after --"),
        (["launch", "t", "--env=1X=y", "--", "posttrain"], "--env '1X=y'"),
        (["launch", "t", "--configs=/nonexistent", "--", "posttrain"], "not a directory"),
        (["setup", "t"], "exactly one of --git=URL"),
        (["setup", "t", "--wheel=/nonexistent/p.whl"], "no such file"),
        (["ssh", "t", "--worker=all"], "need a command after --"),
        (["logs", "t", "--slice=1"], "pass --num-slices too"),
        (["logs", "t", "--worker=x"], "0-based worker index"),
        (["stop", "t", "--", "ls"], "takes no command after --"),
    ],
)
def test_bad_arguments_fail_before_any_gcloud_call(gcloud, args, message):
    done = gcloud.run(f"--zone={ZONE}", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert gcloud.log.read_text() == ""


def test_missing_zone_fails_before_any_gcloud_call(gcloud):
    done = gcloud.run("create", "t", "--accelerator-type=v5p-8")
    assert done.returncode == 2
    assert "no zone: pass --zone=ZONE or set POSTTRAIN_TPU_ZONE" in done.stderr
    assert gcloud.log.read_text() == ""


def test_unknown_accelerator_names_the_accepted_forms(gcloud):
    done = gcloud.run("create", "t", "--accelerator-type=v7x-9", f"--zone={ZONE}")
    assert "v5p-128" in done.stderr and "v5litepod-16" in done.stderr and "v5e-16" in done.stderr


def test_a_failing_gcloud_stops_at_once_naming_the_command(gcloud, tmp_path):
    wheel = tmp_path / "posttrain-0.1.0.tar.gz"
    wheel.write_bytes(b"")
    done = gcloud.run("setup", "my-tpu", f"--zone={ZONE}", f"--wheel={wheel}", rc=1)
    assert done.returncode == 1
    assert f"gcloud exited with code 1: gcloud compute tpus tpu-vm scp {wheel}" in done.stderr
    assert len(gcloud.calls) == 1  # the ssh install never ran


def test_no_gcloud_on_path(gcloud, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done = gcloud.run("stop", "my-tpu", f"--zone={ZONE}", path=str(empty))
    assert done.returncode != 0
    assert "gcloud is not on PATH" in done.stderr


def _remote_commands(gcloud) -> dict:
    """The --command of setup, launch, logs and stop, from --dry-run."""
    commands = {}
    for name, args in {
        "setup": ["setup", "t", "--git=https://example.com/posttrain.git"],
        "launch": ["launch", "t", "--no-configs", "--env=A=a b", "--", *TRAIN],
        "logs": ["logs", "t", "--follow"],
        "stop": ["stop", "t", "--force"],
    }.items():
        done = gcloud.run(f"--zone={ZONE}", "--dry-run", *args)
        assert done.returncode == 0, done.stderr
        commands[name] = _command(shlex.split(done.stdout.splitlines()[-1]))
    return commands


def test_remote_commands_are_valid_posix_sh(gcloud):
    for name, command in _remote_commands(gcloud).items():
        check = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
        assert check.returncode == 0, f"{name}: {check.stderr}"


# A stand-in for the `posttrain` entry point: prints its arguments and one environment variable,
# then runs until SIGTERM, which it reports (like the train loop's checkpoint on SIGTERM).
FAKE_POSTTRAIN = """
import os, signal, sys, time
print("args", " ".join(sys.argv[1:]), "A=" + os.environ.get("A", ""), flush=True)
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM: checkpoint", flush=True), sys.exit(0)))
time.sleep(60)
"""


def test_launch_and_stop_commands_on_a_local_worker(gcloud, tmp_path):
    """Runs the launch/stop shell commands in a scratch $HOME with a fake posttrain. The process
    pattern is narrowed to this test's own process (a unique --run-id), so nothing else on the
    machine can match it."""
    home = tmp_path / "home"
    (home / "posttrain-run").mkdir(parents=True)
    (home / "posttrain-venv" / "bin").mkdir(parents=True)
    entry = home / "posttrain-venv" / "bin" / "posttrain"
    entry.write_text(f"#!{sys.executable}\n{FAKE_POSTTRAIN}")
    entry.chmod(0o755)
    run_id = uuid.uuid4().hex
    train = [*TRAIN, f"--run-id={run_id}"]
    commands = {}
    for name, args in {
        "launch": ["launch", "t", "--no-configs", "--env=A=a b", "--", *train],
        "stop": ["stop", "t"],
    }.items():
        done = gcloud.run(f"--zone={ZONE}", "--dry-run", *args)
        command = _command(shlex.split(done.stdout.splitlines()[-1]))
        assert "'[b]in/posttrain'" in command
        commands[name] = command.replace("'[b]in/posttrain'", f"'[b]in/posttrain .*{run_id}'")
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}

    def sh(command):
        return subprocess.run(
            ["sh", "-c", command], env=env, capture_output=True, text=True, timeout=30
        )

    log = home / "posttrain-logs" / "sft-8b.log"
    try:
        started = sh(commands["launch"])
        assert started.returncode == 0, started.stderr
        assert "started sft-8b" in started.stdout
        assert (home / "posttrain-logs" / "latest.log").resolve() == log.resolve()
        _wait_for(lambda: "args" in log.read_text())
        assert f"args {shlex.join(train[1:])} A=a b" in log.read_text()
        again = sh(commands["launch"])
        assert again.returncode == 1
        assert "already running" in again.stderr
        stopped = sh(commands["stop"])
        assert "sent SIGTERM to posttrain" in stopped.stdout
        _wait_for(lambda: "SIGTERM: checkpoint" in log.read_text())
        _wait_for(lambda: "no posttrain running" in sh(commands["stop"]).stdout)
    finally:
        _kill_own(run_id)


def _wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _kill_own(run_id: str) -> None:
    """Kills the fake posttrain this test started (matched by its unique run id), if still up."""
    found = subprocess.run(["pgrep", "-f", run_id], capture_output=True, text=True).stdout
    for pid in found.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
