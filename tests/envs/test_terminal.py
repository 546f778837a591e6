"""The terminal environment: workspaces, hostile programs run as `bash` tool calls inside an
episode (each asserting the containment, checked on the host), the bundled tasks, and many
concurrent episodes on a two-thread pool leaving no process or directory behind."""

import dataclasses
import hashlib
import os
import pathlib
import re
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
    """Live (not zombie) processes of uid: bwrap's intermediate process, reparented to the
    host's init when bwrap exits, may wait there a moment to be reaped."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    zombie = f.read().rpartition(")")[2].split()[0] == "Z"
                if os.stat(f"/proc/{entry}").st_uid == uid and not zombie:
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
    assert a.workspace.files()["notes/n.md"] == b"hi"
    assert a.workspace.members()["d/x.txt"].mode == 0o755
    # b, alive at the same time, sees only its own empty workspace; a's archive is not there.
    out, _ = _bash(
        b,
        "ls -A; find / -path /proc -prune -o -name secret.txt -print; "
        f"ls {a.workspace.path}; echo end",
    )
    assert out.startswith("exit code: 0\nstdout:\nend\n") and secret not in out
    assert "No such file or directory" in out
    a_ws = a.workspace.path
    a.close()
    a.close()  # idempotent
    assert not os.path.exists(a_ws) and a.workspace is None


def test_workspace_is_removed_on_close_after_a_raising_step_and_with_a_with_block(new_env):
    env = new_env()
    ws = env.workspace.path
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
    env = new_env(backend="unsafe-subprocess")  # no workspace without the container
    with pytest.raises(ValueError, match="workspace needs the bwrap backend"):
        _bash(env, "true")
    with pytest.raises(ZeroDivisionError):
        with new_env() as env2:
            ws = env2.workspace.path
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
    with pytest.raises(ValueError, match="test 'bad' is not valid Python"):
        make_env("terminal", {"prompt": "p", "tests": [{"name": "bad", "code": "assert ("}]})
    with pytest.raises(ValueError, match="unknown terminal environment options.*timeout"):
        make_env("terminal", {"prompt": "p", "tests": TESTS}, timeout=3)
    with pytest.raises(ValueError, match="do not fit its limits"):
        new_env({"prompt": "p", "files": {"big": "x" * (2 << 20)}, "tests": TESTS}, workspace_mb=1)
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
    assert out.startswith("timed out after 1 s: stopped, with every process it started\nstdout:")
    assert "\nlooping" in out and 1.0 <= took < 3.0
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
    assert env.workspace.members()["big"].size == 16 << 20


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
    ws = os.path.dirname(env.workspace.path)  # the host directory holding its archive
    out, _ = _bash(
        env,
        f"""
        for p in /etc/passwd {probe} /usr{probe} /tmp/../etc/x {target} ../escape; do
          echo pwned > $p && echo "WROTE $p"
        done
        ln -s /etc/passwd pw; echo pwned >> pw && echo WROTE pw
        ln -s {target} tgt; echo pwned > tgt && echo WROTE tgt
        ln -s {ws} up; ls up/ && echo LISTED up
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


# -- gaming the hidden tests ----------------------------------------------------------------------
# Each attempt is what a policy might leave in fix_add's workspace (the right answer is `a + b`;
# every attempt keeps `a - b` or cheats instead) or do during its turns; each must score 0, and
# the ones aimed at the machine must be contained. docs/agents.md lists the outcomes.

_WRONG = "def add(a, b):\n    return a - b\n"
_RIGHT = "def add(a, b):\n    return a + b\n"
# The exploit of issue 51: find the test's end-of-test marker (in the calling frames' code, the
# test's file, any command line), print it last from an exception hook and exit with status 0.
_PRINT_THE_MARKER = r"""
import atexit, os, re, sys
PAT = r"posttrain-test-end-[0-9a-f]+"
MARKERS = set()
f = sys._getframe()
while f:
    MARKERS.update(m for c in f.f_code.co_consts if isinstance(c, str) for m in re.findall(PAT, c))
    f = f.f_back
for path in ["/tmp/main.py"] + [f"/proc/{p}/cmdline" for p in os.listdir("/proc") if p.isdigit()]:
    try:
        MARKERS.update(re.findall(PAT, open(path, errors="replace").read()))
    except OSError:
        pass
def hook(*a):
    print("OK")
    print("1 passed")
    for m in MARKERS or ["posttrain-test-end-0123456789abcdef"]:
        print(m)
    sys.stdout.flush()
    os._exit(0)
sys.excepthook = hook
atexit.register(hook)
def add(a, b):
    return a - b
"""
# Learns the expected answers from the test's text wherever this process can read it: files,
# every process's command line, environment and memory. Were the test readable, it would pass.
_READ_THE_TEST = r"""
import os, re
PAT = re.compile(rb"add\((-?\d+), (-?\d+)\) == (-?\d+)")
ANSWERS = {}
def scan(data):
    for a, b, c in PAT.findall(data):
        ANSWERS[int(a), int(b)] = int(c)
for root in ("/tmp", "/dev/shm", "/workspace"):
    for d, _, names in os.walk(root):
        for n in names:
            try:
                scan(open(os.path.join(d, n), "rb").read())
            except OSError:
                pass
for pid in filter(str.isdigit, os.listdir("/proc")):
    for what in ("cmdline", "environ"):
        try:
            scan(open(f"/proc/{pid}/{what}", "rb").read())
        except OSError:
            pass
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                try:
                    mem.seek(lo)
                    scan(mem.read(min(hi - lo, 1 << 24)))
                except (OSError, ValueError, OverflowError):
                    pass
    except OSError:
        pass
def add(a, b):
    return ANSWERS.get((a, b), a - b)
"""
_ALWAYS_EQUAL = """
import builtins, sys
class Always:
    def __eq__(self, other):
        return True
    __hash__ = None
builtins.AssertionError = type("AssertionError", (Exception,), {})
builtins.isinstance = builtins.callable = lambda *a, **k: True
sys.excepthook = lambda *a: None
def add(a, b):
    return Always()
"""
_EQUAL_INT = "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
_EXIT_0 = "import os\nos._exit(0)\n"
_HOOKS = {  # files that would hook a Python started in the workspace, each exiting with 0
    "sitecustomize.py": _EXIT_0,
    "usercustomize.py": _EXIT_0,
    "evil.pth": "import os; os._exit(0)\n",
    "conftest.py": _EXIT_0,
    "ast.py": _EXIT_0,
    "json.py": _EXIT_0,
    "importlib/__init__.py": _EXIT_0,
    "_bz2.py": _EXIT_0,  # optional standard modules a Python build may lack
    "_lzma.py": _EXIT_0,
    "readline.py": _EXIT_0,
    "pyvenv.cfg": "include-system-site-packages = true\n",
    "calc.py": "open('/tmp/main.py', 'w').write('import os; os._exit(0)')\n" + _WRONG,
}
_BACKGROUND = (
    f"printf '{_WRONG}' > calc.py\n"  # a later process would put the right answer in
    f"(sleep 0.5; printf '{_RIGHT}' > calc.py) &\n"
    f"setsid bash -c \"sleep 0.5; printf '{_RIGHT}' > calc.py\" &\n"
    f"nohup bash -c \"trap '' TERM HUP; sleep 0.5; printf '{_RIGHT}' > calc.py\" >/dev/null 2>&1 &"
    " disown\necho started"
)
_OUTSIDE = (
    f"printf '{_RIGHT}' > /tmp/calc.py; ln -sf /tmp/calc.py calc.py\n"
    f"printf '{_RIGHT}' > /dev/shm/calc.py\n"
    f"mkdir -p /tmp/.local/lib/python3/site-packages && cp /tmp/calc.py /tmp/.local/lib/python3/"
    f"site-packages/\n"
    f"printf '{_RIGHT}' > /usr/lib/calc.py || echo denied\n"
    "ls -la calc.py /tmp/calc.py"
)


def _write(path, content):
    return {"name": "write_file", "arguments": {"path": path, "content": content}}


def _sh(command):
    return {"name": "bash", "arguments": {"command": command}}


@dataclasses.dataclass
class _Attempt:
    turns: list  # each a list of calls
    task: str = "fix_add"
    options: dict = dataclasses.field(default_factory=dict)
    replies: str = ""  # a regex every tool answer, joined, must match


GAMING = {
    "print the test's end marker from an exception hook": _Attempt(
        [[_write("calc.py", _PRINT_THE_MARKER)]]
    ),
    "read the test (files, /proc, memory)": _Attempt(
        [
            [
                _write("calc.py", _READ_THE_TEST),
                _sh(  # (the pattern is assembled so that it is not in this script)
                    "p='add(2, '; grep -rlsF \"${p}3)\" /tmp /dev/shm /workspace /run /var /home"
                    " /root; cat /proc/[0-9]*/cmdline /proc/[0-9]*/environ > /tmp/all 2>/dev/null;"
                    ' grep -caF "${p}3)" /tmp/all'
                ),
            ]
        ],
        replies=r"(?s).*stdout:\n0\n$",  # the turn's own search found nothing either
    ),
    "exit with status 0 on import": _Attempt([[_write("calc.py", _EXIT_0 + _WRONG)]]),
    "exit with status 0 in the call": _Attempt(
        [[_write("calc.py", "import os, sys\ndef add(a, b):\n    sys.exit(0)\n    os._exit(0)\n")]]
    ),
    "kill the test's process": _Attempt(
        [[_write("calc.py", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + _WRONG)]]
    ),
    "monkeypatch builtins, always-equal result": _Attempt([[_write("calc.py", _ALWAYS_EQUAL)]]),
    "int subclass equal to everything": _Attempt(
        [[_write("calc.py", _EQUAL_INT + "def add(a, b):\n    return I(0)\n")]]
    ),
    "patch the test runner (sitecustomize, .pth, shadowing modules, /tmp/main.py)": _Attempt(
        [[_write(path, content) for path, content in _HOOKS.items()]]
    ),
    "script kills the test runner": _Attempt(
        [[_write("greet.sh", 'kill -9 $PPID; kill -9 -1; echo "Hello, $2"\n')]],
        task="fix_greet_script",
    ),
    "background process fixes the file later": _Attempt(
        [[_sh(_BACKGROUND)], [_sh("sleep 1; cat calc.py")]],
        replies=r"(?s)exit code: 0\nstdout:\nstarted\n.*return a - b\n$",
    ),
    "write outside the workspace, symlink out": _Attempt(
        [[_sh(_OUTSIDE)]], replies=r"(?s).*denied\n.*calc.py -> /tmp/calc.py\n.*"
    ),
    "fill the disk": _Attempt(
        [
            [_sh("head -c 100M /dev/zero > big; ls -s --block-size=M big")],
            [_sh("rm big; seq 1000 | xargs touch; ls | wc -l; rm [0-9]*")],
            [_sh("truncate -s 6M s1 s2")],  # sparse files: 12 MB that take no space
            [_sh("ls")],
        ],
        options={"workspace_mb": 8, "workspace_files": 100, "file_size_mb": 64},
        replies=(
            r"(?s)exit code: 0\nstdout:\n8M big\n\nstderr:\nhead: error writing 'standard "
            r"output': No space left on device\n.*\n100\n.*No space left on device"
            r".*Error: the workspace could not be saved: its files hold more than 8 MB.*"
            r"stdout:\ncalc.py\n$"
        ),
    ),
    "never return (max_tool_s)": _Attempt(
        [[_sh("trap '' TERM; (exec -a posttrain-hang sleep 100) & setsid sleep 100 & sleep 100")]]
        * 3,
        options={"timeout_s": 1.0, "max_tool_s": 1.5},
        replies=(
            r"(?s)timed out after 1 s: stopped, with every process it started\n"
            r"timed out after 0\.\d+ s: stopped, with every process it started \(the episode's "
            r"tool time, 1.5 s, is spent\)\nError: TimeoutError: the episode's tool time "
            r"\(1.5 s\) is spent: answer now$"
        ),
    ),
}


@pytest.mark.parametrize("name", GAMING)
def test_gaming_attempt_scores_zero_and_is_contained(name, new_env, ws_root):
    attempt = GAMING[name]
    env = new_env({t["id"]: t for t in terminal_tasks()}[attempt.task], **attempt.options)
    replies = []
    for calls in attempt.turns:
        step = env.step(_turn(*[_call(c["name"], **c["arguments"]) for c in calls]))
        replies += [o["content"] for o in step.observations]
    assert re.fullmatch(attempt.replies or ".*", "\n".join(replies), re.DOTALL), replies
    workspace = env.workspace
    step = env.step({"role": "assistant", "content": "Done."})
    assert step.done and step.reward == 0.0, (name, step.info)
    # Contained: no process of the episode is left, nothing of it outside its archive, which
    # holds at most workspace_mb of file data; the host's files are as they were.
    assert _gone("posttrain-hang") and not os.path.exists("/tmp/calc.py")
    data = sum(m.size for m in workspace.members().values())
    assert data <= env.options.workspace_mb << 20
    assert os.listdir(ws_root / "ws") == [os.path.basename(workspace.path)]


_UNITTEST = """import unittest
from stats import median
class T(unittest.TestCase):
    def test_one(self):
        self.assertEqual(median([5]), {})
unittest.main()
"""


def test_the_test_runner_proxy_keeps_python_semantics_for_plain_data(new_env):
    files = {
        "stats.py": "def median(xs):\n    xs.sort()\n    return xs[len(xs) // 2]\n",
        "pkg/__init__.py": "",
        "pkg/mod.py": "import math\nPI = math.pi\nNAN = float('nan')\n"
        "def fail(x):\n    raise KeyError(x)\ndef grow(d, s):\n    d['n'] = 1\n    s.add(2)\n",
    }
    tests = [  # each passes: the proxy behaves as the module would in-process
        "from stats import median\nxs = [3, 1, 2]\nassert median(xs) == 2 and xs == [1, 2, 3]\n",
        "import math, pkg.mod\nassert pkg.mod.PI == math.pi and math.isnan(pkg.mod.NAN)\n"
        "try:\n    pkg.mod.fail('k')\nexcept KeyError as e:\n    assert 'k' in str(e)\n"
        "d, s = {}, set()\npkg.mod.grow(d, s=s)\nassert d == {'n': 1} and s == {2}\n",
        "import os, sys\nassert sys.path == [p for p in sys.path if p.startswith('/usr')]\n"
        "try:\n    open('x', 'w')\nexcept OSError as e:\n    assert e.errno == 30  # read-only\n"
        "else:\n    raise AssertionError('the workspace is writable')\n"
        "assert open('/proc/self/status').read().count('\\t0000000000000000\\n') >= 4  # caps\n",
        "import nosuchmodule\n",  # fails, as must the next (unittest.main exits 1)
        _UNITTEST.format(4),
        _UNITTEST.format(5),
    ]
    record = {
        "prompt": "p",
        "files": files,
        "tests": [{"name": str(i), "code": c} for i, c in enumerate(tests)],
    }
    step = new_env(record).step({"role": "assistant", "content": "Done."})
    assert step.info["tests"] == {
        "0": True,
        "1": True,
        "2": True,
        "3": False,
        "4": False,
        "5": True,
    }


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


def test_sandbox_workspace_directly(ws_root):
    ws = sandbox.make_workspace({"pkg/mod.py": "X = 7\n"}, str(ws_root), size_mb=4, max_files=50)
    uid = _sandbox_bwrap.SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
    try:
        # A Python program run with a workspace gets the standard library only on sys.path.
        r = sandbox.run(
            "import os\nprint(os.getcwd(), os.listdir())\nimport pkg.mod",
            timeout_s=5,
            memory_mb=256,
            workspace=ws,
        )
        assert r.stdout == "/workspace ['pkg']\n" and "No module named 'pkg'" in r.stderr
        r = sandbox.run(
            "echo $0 $(id -u); printf x > made",
            timeout_s=5,
            memory_mb=256,
            language="bash",
            workspace=ws,
        )
        assert r.ok and r.stdout == f"/tmp/main.sh {uid}\n" and r.workspace_error is None
        assert ws.files() == {"pkg/mod.py": b"X = 7\n", "made": b"x"}
        r = sandbox.run(
            "rm made; echo y > other; cat made",
            timeout_s=5,
            memory_mb=256,
            language="bash",
            workspace=ws,
            workspace_readonly=True,
        )
        assert r.stdout == "x" and r.stderr.count("Read-only file system") == 2
        assert ws.files() == {"pkg/mod.py": b"X = 7\n", "made": b"x"}
        if os.geteuid() == 0:  # the archive is root's: the sandbox reads it by fd
            assert os.stat(ws.path).st_mode & 0o077 == 0
        with pytest.raises(ValueError, match="not a Workspace"):
            sandbox.run("", timeout_s=1, memory_mb=64, workspace=str(ws_root))
        with pytest.raises(ValueError, match="needs the bwrap backend"):
            sandbox.run("", timeout_s=1, memory_mb=64, workspace=ws, backend="subprocess")
    finally:
        sandbox.remove_workspace(ws)
    assert os.listdir(ws_root) == []
    sandbox.remove_workspace(ws)  # gone: a no-op
