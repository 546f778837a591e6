"""The terminal environment: workspaces, hostile programs run as `bash` tool calls inside an
episode (each asserting the containment, checked on the host), the bundled tasks, and many
concurrent episodes on a two-thread pool leaving no process or directory behind."""

import dataclasses
import hashlib
import os
import pathlib
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

from posttrain.envs import ElasticPool, TerminalEnvironment, make_env, terminal_tasks
from posttrain.rewards import _sandbox_bwrap, sandbox
from tests.rewards.test_sandbox import _pids_with

pytestmark = pytest.mark.skipif(
    _sandbox_bwrap.find_bwrap() is None,
    reason="bubblewrap not installed (apt-get install bubblewrap)",
)

TESTS = [{"name": "t", "code": "import os\nassert os.path.exists('done')\n"}]


def _call(name, **arguments):
    return {
        "id": uuid.uuid4().hex[:9],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _turn(*calls, **extra):
    return {"role": "assistant", "content": "", "tool_calls": list(calls), **extra}


def _bash(env, command):
    """(the tool's answer, seconds the step took)."""
    start = time.monotonic()
    step = env.step(_turn(_call("bash", command=command)))
    assert not step.done and len(step.observations) == 1
    return step.observations[0]["content"], time.monotonic() - start


def _gone(tag: str) -> bool:
    """No host process has tag in its command line, within 1 s: the kernel kills what is left
    in a container's PID namespace when its PID 1 exits, which bwrap reports a moment before."""
    deadline = time.monotonic() + 1.0
    while _pids_with(tag) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _pids_with(tag) == []


def _children(pid: int) -> list[str]:
    """Names of the live processes whose parent is pid."""
    names = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat.rpartition(")")[0].partition("(")[2], stat.rpartition(")")[2].split()
        if int(rest[1]) == pid and rest[0] != "Z":
            names.append(name)
    return names


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.fixture
def ws_root():
    """A directory for workspaces that the sandbox's uid can reach (pytest's tmp_path is private
    to root); must be empty at teardown."""
    root = tempfile.mkdtemp(prefix="posttrain-test-")
    os.chmod(root, 0o711)
    yield pathlib.Path(root)
    leftover = os.listdir(root)
    shutil.rmtree(root)
    assert leftover == []


@pytest.fixture
def new_env(ws_root):
    """new_env(record=None, **options): a reset terminal environment with its workspace in
    ws_root; closed at teardown."""
    root = ws_root / "ws"
    root.mkdir()
    envs = []

    def make(record=None, **options):
        record = record or {"prompt": "go", "tests": TESTS}
        options = {"workspace_root": str(root), "timeout_s": 5.0, **options}
        env = make_env("terminal", record, **options)
        envs.append(env)
        env.reset()
        return env

    yield make
    for env in envs:
        env.close()
    assert os.listdir(root) == []
    root.rmdir()


# -- workspaces ------------------------------------------------------------------------------


def test_files_persist_across_calls_and_episodes_cannot_see_each_other(new_env):
    # (b walks the whole filesystem: on a cold page cache that took 37 s on a 2-core CI machine)
    a, b = (
        new_env({"prompt": "go", "files": {"src/x.txt": "given\n"}, "tests": TESTS}),
        new_env(timeout_s=120.0),
    )
    secret = uuid.uuid4().hex
    out, _ = _bash(
        a, f"echo {secret} > secret.txt && mkdir -p d && cp src/x.txt d/ && chmod +x d/x.txt"
    )
    assert out == "exit code: 0"
    out, _ = _bash(a, "cat secret.txt d/x.txt && test -x d/x.txt && pwd")
    assert out == f"exit code: 0\nstdout:\n{secret}\ngiven\n/workspace\n"
    step = a.step(
        _turn(
            _call("write_file", path="notes/n.md", content="hi"),
            _call("read_file", path="/workspace/secret.txt"),
        )
    )
    assert [o["content"] for o in step.observations] == [
        "wrote 2 bytes to notes/n.md",
        f"{secret}\n",
    ]
    assert open(os.path.join(a.workspace, "notes/n.md")).read() == "hi"
    # b, alive at the same time, sees only its own empty workspace; a's host path is not there.
    out, _ = _bash(
        b,
        f"ls -A; find / -path /proc -prune -o -name secret.txt -print; ls {a.workspace}; echo end",
    )
    assert out.startswith("exit code: 0\nstdout:\nend\n") and secret not in out
    assert "No such file or directory" in out
    a_ws = a.workspace
    a.close()
    a.close()  # idempotent
    assert not os.path.exists(a_ws) and a.workspace is None


def test_workspace_is_removed_on_close_after_a_raising_step_and_with_a_with_block(new_env):
    env = new_env()
    ws = env.workspace
    with pytest.raises(KeyError):  # a malformed call: no "function"
        env.step(_turn({"id": "x"}))
    env.close()
    assert not os.path.exists(ws)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(_turn())
    env = new_env()  # a broken sandbox fails the step; it is not the model's tool error
    env.options = dataclasses.replace(env.options, backend="docker")
    with pytest.raises(ValueError, match="backend 'docker'"):
        _bash(env, "true")
    with pytest.raises(ZeroDivisionError):
        with new_env() as env2:
            ws = env2.workspace
            _bash(env2, "echo x > f")
            raise ZeroDivisionError
    assert not os.path.exists(ws)


def test_bad_records_and_options_fail_clearly(new_env, tmp_path):
    for name in ["/etc/evil", "../evil", "a/../../evil"]:
        env = TerminalEnvironment({"prompt": "p", "files": {name: "x"}, "tests": TESTS})
        with pytest.raises(ValueError, match="relative path inside the workspace"):
            env.reset()
    assert not os.path.exists("/etc/evil") and not os.path.exists(tmp_path.parent / "evil")
    with pytest.raises(ValueError, match="needs 'tests'"):
        make_env("terminal", {"prompt": "p"})
    with pytest.raises(ValueError, match="unknown terminal environment options.*timeout"):
        make_env("terminal", {"prompt": "p", "tests": TESTS}, timeout=3)
    env = new_env()
    step = env.step(
        _turn(_call("read_file", path="/etc/passwd"), _call("write_file", path="..", content=""))
    )
    assert [o["content"] for o in step.observations] == [
        "Error: ValueError: '/etc/passwd' is not a file inside /workspace",
        "Error: ValueError: '..' is not a file inside /workspace",
    ]
    assert step.info["tool_errors"] == 2


# -- hostile programs, as bash calls inside an episode ------------------------------------------


def test_fork_bomb_is_contained(new_env):
    env, tag = new_env(timeout_s=2.0, max_procs=32), f"bomb-{uuid.uuid4().hex}"
    peak, done = [0], threading.Event()

    def watch():  # the most bomb processes alive at once, seen from the host
        while not done.is_set():
            peak[0] = max(peak[0], len(_pids_with(tag)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:  # the script outlives the timeout, so the bomb is still forking when it is killed
        out, took = _bash(env, f"exec -a {tag} bash -c ':(){{ :|:& }};:; sleep 10'")
    finally:
        done.set()
        watcher.join()
    assert out.startswith("timed out after 2 s") and took < 4.0
    assert "Resource temporarily unavailable" in out  # fork failed at RLIMIT_NPROC
    assert 1 < peak[0] <= 32
    assert _gone(tag)
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_infinite_loop_is_killed_at_the_timeout(new_env):
    env = new_env(timeout_s=1.0)
    out, took = _bash(env, "echo looping; while :; do :; done")
    assert out.startswith("timed out after 1 s (killed)\nstdout:\nlooping") and 1.0 <= took < 3.0
    out, _ = _bash(env, "echo alive")  # the episode goes on
    assert out == "exit code: 0\nstdout:\nalive\n"


def test_allocating_ten_times_the_memory_limit_fails(new_env):
    env = new_env(memory_mb=64)
    out, _ = _bash(env, "python3 -c 'x = bytearray(640 << 20)'; echo rc=$?")
    assert out.startswith("exit code: 0\nstdout:\nrc=1\n") and out.rstrip().endswith("MemoryError")


def test_a_1gb_file_stops_at_the_file_size_limit(new_env):
    env = new_env(file_size_mb=16)
    out, _ = _bash(env, "head -c 1G /dev/zero > big; echo rc=$?")
    assert "rc=153" in out and "File size limit exceeded" in out, out  # 128 + SIGXFSZ (25)
    assert os.path.getsize(os.path.join(env.workspace, "big")) == 16 << 20


def test_network_is_unreachable(new_env):
    env = new_env()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        out, took = _bash(
            env,
            f"echo hi > /dev/tcp/127.0.0.1/{port}; echo hi > /dev/tcp/1.1.1.1/80; "
            f"python3 -c 'import socket; socket.getaddrinfo(\"example.com\", 80)'",
        )
        assert "Connection refused" in out and "Network is unreachable" in out and "gaierror" in out
        assert took < 3.0  # refused at once, no connect timeouts
        assert select.select([listener], [], [], 0)[0] == []  # nothing reached the host
    finally:
        listener.close()


def test_host_files_and_environment_are_invisible(new_env, tmp_path, monkeypatch):
    (tmp_path / "host-secret.txt").write_text("s3cret")
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "env-s3cret")
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = new_env()
    paths = [
        "/etc/shadow",
        "/etc/passwd",
        "/root",
        "/home",
        checkout,
        str(tmp_path / "host-secret.txt"),
    ]
    out, _ = _bash(
        env,
        f"for p in {' '.join(paths)}; do cat $p || ls $p; done; env; cat /proc/1/environ; ls /etc",
    )
    assert out.count("No such file or directory") == 2 * len(paths)
    assert "s3cret" not in out and "root:x:" not in out, out
    assert "\nHOME=/tmp\n" in out and "POSTTRAIN_TEST_SECRET" not in out
    assert "\nld.so.cache\nlocaltime\n" in out


def test_writes_outside_the_workspace_and_symlink_escapes_fail(new_env, ws_root):
    # Host files the sandbox's uid could reach and write, were they visible in the container.
    target = ws_root / "host-target.txt"
    target.write_text("original")
    target.chmod(0o666)  # writable by the sandbox's uid, were it visible
    keep = ws_root / "keep"
    keep.mkdir()
    (keep / "kept.txt").write_text("kept")
    passwd = hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest()
    probe = f"/posttrain-probe-{uuid.uuid4().hex}"
    env = new_env()
    ws = env.workspace
    out, _ = _bash(
        env,
        f"""
        for p in /etc/passwd {probe} /usr{probe} /tmp/../etc/x {target} ../escape; do
          echo pwned > $p && echo "WROTE $p"
        done
        ln -s /etc/passwd pw; echo pwned >> pw && echo WROTE pw
        ln -s {target} tgt; echo pwned > tgt && echo WROTE tgt
        ln -s {ws}/.. up; ls up/ && echo LISTED up
        ln -s {keep} keep; ls keep/ && echo LISTED keep
        ls -A /workspace
        """,
    )
    assert "WROTE" not in out and "LISTED" not in out and "kept.txt" not in out, out
    step = env.step(
        _turn(
            _call("read_file", path="pw"),
            _call("write_file", path="tgt", content="pwned"),
            _call("write_file", path="pw", content="pwned"),
        )
    )
    assert [o["content"].startswith("Error: OSError:") for o in step.observations] == [True] * 3
    assert "root:" not in step.observations[0]["content"]
    assert hashlib.sha256(open("/etc/passwd", "rb").read()).hexdigest() == passwd
    assert target.read_text() == "original" and not os.path.exists(probe)
    assert not os.path.exists(ws_root / "ws" / "escape")
    env.close()  # deleting the workspace does not follow its symlinks
    assert (keep / "kept.txt").read_text() == "kept" and target.read_text() == "original"
    target.unlink()
    shutil.rmtree(keep)


def test_a_background_process_does_not_outlive_the_call(new_env):
    env, tag = new_env(), f"daemon-{uuid.uuid4().hex}"
    out, took = _bash(
        env,
        f"(exec -a {tag}-1 sleep 60) &"
        f" setsid bash -c 'trap \"\" TERM HUP; exec -a {tag}-2 sleep 60' &"
        f" nohup bash -c 'exec -a {tag}-3 sleep 60' > /dev/null 2>&1 & disown;"
        " sleep 0.2; echo started",
    )
    assert out == "exit code: 0\nstdout:\nstarted\n" and took < 2.0
    assert _gone(tag)


def test_killing_its_parent_and_everyone_leaves_the_host_alone(new_env):
    neighbour = subprocess.Popen(["sleep", "30"])
    try:
        env = new_env()
        out, _ = _bash(
            env,
            f"echo ppid=$PPID; kill -9 $PPID; kill -9 {neighbour.pid}; kill -9 {os.getpid()};"
            " kill -9 -1; echo survived",
        )
        assert "stdout:\nppid=1\nsurvived\n" in out
        # Host pids do not exist in its namespace; kill(-1) finds no one but itself and PID 1.
        for pid in (neighbour.pid, os.getpid(), -1):
            assert f"kill: ({pid}) - No such process" in out
        assert neighbour.poll() is None  # the host process next door still runs
        assert _bash(env, "echo next")[0] == "exit code: 0\nstdout:\nnext\n"
    finally:
        neighbour.send_signal(signal.SIGKILL)
        neighbour.wait()


# -- tasks and rewards ---------------------------------------------------------------------------


def _solve(env, solution):
    step = env.step(_turn(*[_call(c["name"], **c["arguments"]) for c in solution]))
    assert step.info["tool_errors"] == 0, step.observations
    return env.step({"role": "assistant", "content": "Done."})


@pytest.mark.parametrize("task", terminal_tasks(), ids=lambda t: t["id"])
def test_every_bundled_task_fails_as_given_and_passes_after_its_solution(task, new_env):
    env = new_env(task)
    step = env.step({"role": "assistant", "content": "Nothing to do."})
    total = len(task["tests"])
    assert step.done and step.reward == 0.0
    assert (step.info["tests_passed"], step.info["tests_total"]) == (0, total)
    env = new_env(task)
    step = _solve(env, task["solution"])
    assert step.done and step.reward == 1.0 and step.info["tests_passed"] == total
    assert step.info["tests"] == {t["name"]: True for t in task["tests"]}


def test_reward_is_the_passed_fraction_less_penalties(new_env):
    task = {t["id"]: t for t in terminal_tasks()}["fix_add"]
    half = [
        {
            "name": "write_file",
            "arguments": {"path": "calc.py", "content": "def add(a, b):\n    return abs(a + b)\n"},
        }
    ]
    step = _solve(new_env(task), half)
    assert step.reward == 0.5 and step.info["tests"] == {"positive": True, "negative": False}
    env = new_env(task, format_penalty=0.1, turn_penalty=0.05, free_turns=2)
    env.step(_turn(tool_call_errors=["bad JSON in <tool_call>"]))
    step = _solve(env, task["solution"])  # 3 turns: one beyond the free two
    assert step.reward == pytest.approx(1.0 - 0.1 - 0.05)
    assert (step.info["turns"], step.info["format_error_turns"]) == (3, 1)


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)"])
def test_code_that_exits_early_fails_the_tests(new_env, exit_call):
    task = {t["id"]: t for t in terminal_tasks()}["fix_add"]
    hack = [
        {
            "name": "write_file",
            "arguments": {"path": "calc.py", "content": f"import os, sys\n{exit_call}\n"},
        }
    ]
    step = _solve(new_env(task), hack)
    assert step.reward == 0.0


# -- many episodes at once -----------------------------------------------------------------------


def test_64_concurrent_episodes_on_two_threads_leave_nothing_behind(ws_root):
    root, tag = ws_root / "ws", f"episode-{uuid.uuid4().hex}"
    root.mkdir()
    threads_seen = []  # this pool's threads alive (other tests' pools may still be winding down)
    record = {
        "prompt": "go",
        "tests": [{"name": "n", "code": "assert open('n.txt').read().strip().isdigit()"}],
    }

    def episode(i):
        env = make_env("terminal", record, workspace_root=str(root), timeout_s=5.0)
        try:
            env.reset()
            _bash(env, f"echo {i} > n.txt")
            out, _ = _bash(env, f"(exec -a {tag} sleep 30) & cat n.txt")
            assert out == f"exit code: 0\nstdout:\n{i}\n"
            _bash(env, f"test $(cat n.txt) = {i} && touch ok")
            threads_seen.append(sum(t.name == pool.name for t in threading.enumerate()))
            step = env.step({"role": "assistant", "content": "done"})
            return step.reward
        finally:
            env.close()

    pool = ElasticPool(min_workers=0, max_workers=2, idle_s=0.5)
    start = time.monotonic()
    with pool:
        rewards = [f.result() for f in [pool.submit(episode, i) for i in range(64)]]
    took = time.monotonic() - start
    assert rewards == [1.0] * 64 and took < 60
    assert pool.peak <= 2 and max(threads_seen) <= 2
    assert os.listdir(root) == []
    root.rmdir()
    assert _gone(tag)
    assert not [n for n in _children(os.getpid()) if n in ("bwrap", "setpriv", "bash", "python3")]
    if os.geteuid() == 0 and "PYTEST_XDIST_WORKER" not in os.environ:
        # Nothing of the sandbox's uid is left (under xdist, another worker's sandboxes may run).
        deadline = time.monotonic() + 2.0
        while _uid_pids(_sandbox_bwrap.SANDBOX_UID) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _uid_pids(_sandbox_bwrap.SANDBOX_UID) == []


def test_sandbox_bash_and_workspace_directly(ws_root, tmp_path):
    ws = sandbox.make_workspace({"pkg/mod.py": "X = 7\n"}, root=str(ws_root))
    try:
        r = sandbox.run(
            "import pkg.mod, os\nprint(pkg.mod.X, os.getcwd())",
            timeout_s=5,
            memory_mb=256,
            workspace=ws,
        )
        assert r.stdout == "7 /workspace\n"
        r = sandbox.run(
            "echo $0 $(id -u); printf x > made",
            timeout_s=5,
            memory_mb=256,
            language="bash",
            workspace=ws,
        )
        assert (
            r.ok
            and r.stdout
            == f"/tmp/main.sh {_sandbox_bwrap.SANDBOX_UID if os.geteuid() == 0 else os.geteuid()}\n"
        )
        # The workspace is last on sys.path: it cannot shadow the standard library.
        open(os.path.join(ws, "json.py"), "w").write("raise SystemExit('shadowed')")
        r = sandbox.run(
            "import json; print(json.dumps(1))", timeout_s=5, memory_mb=256, workspace=ws
        )
        assert r.stdout == "1\n"
        with pytest.raises(ValueError, match="not a directory"):
            sandbox.run("", timeout_s=1, memory_mb=64, workspace=str(tmp_path / "nope"))
        os.symlink(ws, tmp_path / "link")
        if os.geteuid() == 0:  # pytest's tmp_path is private to root: bwrap could not bind it
            with pytest.raises(sandbox.SandboxError, match="cannot search.*o\\+x"):
                sandbox.make_workspace(root=str(tmp_path))
        with pytest.raises(ValueError, match="is a symlink"):  # the workspace itself may not be
            sandbox.run("", timeout_s=1, memory_mb=64, workspace=str(tmp_path / "link"))
        # The unsafe backend runs bash in the workspace too (no isolation: it warns).
        with pytest.warns(sandbox.UnsafeSandboxWarning):
            r = sandbox.run(
                "cat made; pwd",
                timeout_s=5,
                memory_mb=256,
                language="bash",
                workspace=ws,
                backend="subprocess",
            )
        assert r.stdout == f"x{ws}\n" and r.backend == "subprocess"
    finally:
        sandbox.remove_workspace(ws)
    assert not os.path.exists(ws)
    sandbox.remove_workspace(ws)  # gone: a no-op
