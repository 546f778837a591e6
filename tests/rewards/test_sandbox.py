"""The sandbox: basic runs, and hostile programs contained with the host unaffected.

Every hostile program runs inside `sandbox.run`; each test asserts the specific outcome (killed,
denied, not visible) and that the run ended within its timeout + 2 s.
"""

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from posttrain.rewards import _sandbox_bwrap, sandbox

pytestmark = pytest.mark.skipif(
    _sandbox_bwrap.find_bwrap() is None,
    reason="bubblewrap not installed (apt-get install bubblewrap)",
)


def _run(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, **kwargs):
    """sandbox.run with dedented code; asserts the run ended within timeout + 2 s."""
    start = time.monotonic()
    result = sandbox.run(textwrap.dedent(code), timeout_s=timeout_s, memory_mb=memory_mb, **kwargs)
    assert time.monotonic() - start < timeout_s + 2, result
    assert result.wall_s < timeout_s + 2
    assert result.backend == "bwrap"
    return result


def _pids_with(tag: str) -> list[int]:
    """Host pids whose command line contains tag (what `pgrep -f tag` finds)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if tag.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _json(result) -> dict:
    assert result.exit_code == 0, result
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_runs_program_with_stdin_files_and_exit_code():
    r = _run(
        """
        import sys, helper
        print(helper.X, sys.stdin.read().upper(), __name__, __file__)
        exit(3)
        """,
        stdin="abc",
        files={"helper.py": "X = 41 + 1", "data/in.txt": "x"},
    )
    assert (r.exit_code, r.stdout, r.timed_out, r.ok) == (
        3,
        "42 ABC __main__ /tmp/main.py\n",
        False,
        False,
    )
    r = _run("import sys; sys.stdout.write(sys.stdin.read())", stdin="x" * 300_000)
    assert r.ok and len(r.stdout) == 300_000  # stdin larger than a pipe buffer
    r = _run("def f():\n    1 / 0\nf()")
    assert r.exit_code == 1 and r.stderr.startswith("Traceback") and "<string>" not in r.stderr
    assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_fork_bomb_is_denied_more_processes():
    tag = f"forkbomb-{uuid.uuid4().hex}"
    bomb = "import os\nwhile True:\n    os.fork()\n"
    r = _run(
        f"import os\nos.execv('/usr/bin/python3', ['python3', '-c', {bomb!r}, {tag!r}])",
        timeout_s=5,
        max_procs=32,
    )
    # RLIMIT_NPROC (per container) makes fork fail; the processes die of it or at the timeout.
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in r.stderr
    assert _pids_with(tag) == []
    assert subprocess.run(["true"]).returncode == 0  # the host still forks


def test_fork_bomb_that_swallows_errors_is_killed_at_timeout():
    tag = f"forkbomb-{uuid.uuid4().hex}"
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = _run(
        f"import os\nos.execv('/usr/bin/python3', ['python3', '-c', {bomb!r}, {tag!r}])",
        timeout_s=1.5,
    )
    assert r.timed_out and r.killed_by_signal == signal.SIGKILL and r.exit_code is None
    assert _pids_with(tag) == []


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_infinite_loop_and_sleep_are_killed_at_timeout(code):
    r = _run(code, timeout_s=1.0)
    assert r.timed_out and r.killed_by_signal == signal.SIGKILL and r.exit_code is None
    assert 1.0 <= r.wall_s < 3.0


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(640 << 20)", "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))"],
)
def test_allocating_ten_times_the_memory_limit_fails(code):
    r = _run(code, memory_mb=64)
    assert r.oom and r.exit_code == 1 and r.stderr.rstrip().endswith("MemoryError")


def test_writing_a_1gb_file_stops_at_the_file_size_limit():
    r = _run(
        """
        import json
        written, err = 0, None
        try:
            with open("/tmp/big", "wb") as f:
                for _ in range(1024):
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written += 1 << 20
        except OSError as e:
            err = e.errno
        print(json.dumps({"errno": err, "written": written}))
        """,
        file_size_mb=16,
    )
    out = _json(r)
    assert out["errno"] == errno.EFBIG and out["written"] <= 16 << 20


def test_filling_tmp_with_many_files_stops_at_the_tmpfs_size():
    r = _run(
        """
        import json
        written, err = 0, None
        try:
            for i in range(1000):
                with open(f"/tmp/f{i}", "wb") as f:
                    f.write(b"x" * (8 << 20))
                written += 8 << 20
        except OSError as e:
            err = e.errno
        print(json.dumps({"errno": err, "written": written}))
        """,
        tmp_mb=32,
    )
    out = _json(r)
    assert out["errno"] == errno.ENOSPC and out["written"] <= 32 << 20


def test_printing_100mb_is_capped_and_marked_truncated():
    r = _run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))")
    assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated
    assert r.stdout == "x" * (1 << 20)


def test_network_is_unreachable():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        r = _run(
            f"""
            import json, socket, time
            out = {{}}
            targets = [("host_loopback", ("127.0.0.1", {port})), ("public", ("1.1.1.1", 80))]
            for name, addr in targets:
                start = time.monotonic()
                try:
                    socket.create_connection(addr, timeout=10).close()
                    out[name] = "connected"
                except OSError as e:
                    out[name] = e.errno
                out[name + "_s"] = time.monotonic() - start
            try:
                socket.getaddrinfo("example.com", 80)
                out["dns"] = "resolved"
            except OSError as e:
                out["dns"] = type(e).__name__
            print(json.dumps(out))
            """
        )
        out = _json(r)
        # The container has its own loopback: the host's listener is not there.
        assert out["host_loopback"] == errno.ECONNREFUSED
        assert out["public"] == errno.ENETUNREACH and out["public_s"] < 1.0  # fails at once
        assert out["dns"] == "gaierror"
        assert select.select([listener], [], [], 0)[0] == []  # no connection reached the host
    finally:
        listener.close()


def test_host_files_and_environment_are_not_visible(tmp_path, monkeypatch):
    (tmp_path / "host-secret.txt").write_text("s3cret")
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "env-s3cret")
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [
        "/etc/shadow",
        "/root",
        "/home",
        checkout,
        sys.prefix,
        str(tmp_path / "host-secret.txt"),
    ]
    r = _run(
        f"""
        import json, os
        out = {{"etc": sorted(os.listdir("/etc")), "tmp": sorted(os.listdir("/tmp"))}}
        for p in {paths!r}:
            try:
                out[p] = os.listdir(p) if os.path.isdir(p) else open(p).read()
            except OSError as e:
                out[p] = e.errno
        out["env"] = ""
        for p in ["/proc/self/environ", "/proc/1/environ"]:
            try:
                out["env"] += open(p).read()
            except OSError:
                pass
        print(json.dumps(out))
        """
    )
    out = _json(r)
    for p in paths:
        assert out[p] == errno.ENOENT, p
    assert set(out["etc"]) <= {"ld.so.cache", "localtime"} and out["tmp"] == ["main.py"]
    assert "env-s3cret" not in out["env"] and "s3cret" not in r.stdout


def test_writing_outside_tmp_is_denied():
    probe = f"/posttrain-probe-{uuid.uuid4().hex}"
    targets = [probe, "/usr/" + probe, "/etc/passwd", "/dev/" + probe, "/proc/" + probe]
    r = _run(
        f"""
        import json
        out = {{}}
        for p in {targets!r} + ["/tmp/ok", "/dev/shm/ok"]:
            try:
                with open(p, "w") as f:
                    f.write("x")
                out[p] = "written"
            except OSError as e:
                out[p] = e.errno
        print(json.dumps(out))
        """
    )
    out = _json(r)
    assert out.pop("/tmp/ok") == "written" and out.pop("/dev/shm/ok") == "written"
    assert {p: out[p] for p in targets[:4]} == dict.fromkeys(targets[:4], errno.EROFS)
    assert out[targets[4]] in (errno.ENOENT, errno.EACCES)  # procfs refuses new files
    assert not os.path.exists(probe) and not os.path.exists("/usr/" + probe)


def test_killing_its_parent_and_everything_leaves_the_host_alone():
    neighbour = subprocess.Popen(["sleep", "30"])
    try:
        r = _run(
            f"""
            import json, os, signal
            out = {{"ppid": os.getppid()}}
            for name, pid in [("parent", os.getppid()), ("host_pid", {neighbour.pid}),
                              ("host_test", {os.getpid()}), ("everyone", -1)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                    out[name] = "sent"
                except OSError as e:
                    out[name] = e.errno
            print(json.dumps(out))
            """
        )
        out = _json(r)  # the program itself survived its parent's SIGKILL and exited 0
        # Its parent is the container's PID 1, which ignores SIGKILL from inside; host pids do
        # not exist in its PID namespace; kill(-1) reaches no one (nothing else in there).
        assert out["ppid"] == 1 and out["parent"] == "sent"
        assert out["host_pid"] == errno.ESRCH and out["host_test"] == errno.ESRCH
        assert out["everyone"] == errno.ESRCH
        assert neighbour.poll() is None  # the host process next door is still running
    finally:
        neighbour.kill()
        neighbour.wait()


def test_background_process_does_not_outlive_the_run():
    tag = f"daemon-{uuid.uuid4().hex}"
    r = _run(
        f"""
        import os, subprocess, time
        if os.fork() == 0:  # double fork + setsid: a daemon, out of the run's process group
            os.setsid()
            subprocess.Popen(["/usr/bin/python3", "-c",
                              "import signal, time\\n"
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
                              "open('/tmp/started', 'w').close()\\n"
                              "time.sleep(60)", {tag!r}])
            os._exit(0)
        while not os.path.exists("/tmp/started"):
            time.sleep(0.01)
        print("daemon started")
        """,
        timeout_s=5,
    )
    assert r.stdout == "daemon started\n" and r.exit_code == 0 and r.wall_s < 2.0
    assert _pids_with(tag) == []  # killed with the container when main.py exited


def test_concurrent_runs_cannot_read_each_others_tmp():
    secret = uuid.uuid4().hex
    writer = f"""
import time
open("/tmp/secret.txt", "w").write({secret!r})
print("written")
time.sleep(1.5)
"""
    reader = """
import json, os, time
time.sleep(0.5)
found = []
for root in ["/tmp", "/dev/shm", "/proc"]:
    for d, _, names in os.walk(root):
        found += [os.path.join(d, n) for n in names if n == "secret.txt"]
print(json.dumps({"tmp": sorted(os.listdir("/tmp")), "found": found, "pids": sorted(
    int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""
    with sandbox.SandboxPool(2, timeout_s=5, memory_mb=256) as pool:
        w, rd = pool.map([writer, reader])
    assert w.stdout == "written\n"
    out = _json(rd)
    assert out == {"tmp": ["main.py"], "found": [], "pids": [1, 2]}
    assert secret not in rd.stdout


def test_pool_runs_concurrently_in_order():
    with sandbox.SandboxPool(2, timeout_s=5, memory_mb=256) as pool:
        start = time.monotonic()
        futures = [pool.submit(f"import time; time.sleep(0.4); print({i})") for i in range(4)]
        results = [f.result() for f in futures]
        assert time.monotonic() - start < 1.5  # two at a time, not four in a row
        assert [r.stdout for r in pool.map(["print(input())"] * 2, stdins=["a", "b"])] == [
            "a\n",
            "b\n",
        ]
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]


def test_missing_bwrap_refuses_with_install_instructions(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BWRAP", "/nonexistent/bwrap")
    monkeypatch.delenv("POSTTRAIN_SANDBOX", raising=False)
    with pytest.raises(sandbox.SandboxUnavailableError, match="apt-get install -y bubblewrap") as e:
        sandbox.run("print(1)", timeout_s=5, memory_mb=256)
    assert "/nonexistent/bwrap" in str(e.value) and "POSTTRAIN_SANDBOX=unsafe-subprocess" in str(
        e.value
    )


def test_unsafe_subprocess_backend_is_explicit_and_warns(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_BWRAP", "/nonexistent/bwrap")
    with pytest.warns(sandbox.UnsafeSandboxWarning, match="no filesystem or network isolation"):
        r = sandbox.run(
            "import helper; print(helper.X)",
            timeout_s=5,
            memory_mb=256,
            files={"helper.py": "X = 7"},
            backend="subprocess",
        )
    assert (r.stdout, r.exit_code, r.backend) == ("7\n", 0, "subprocess")
    monkeypatch.setenv("POSTTRAIN_SANDBOX", "unsafe-subprocess")
    with pytest.warns(sandbox.UnsafeSandboxWarning, match="rlimits"):
        r = sandbox.run("import time; time.sleep(30)", timeout_s=0.5, memory_mb=256)
    assert r.timed_out and r.wall_s < 2.5


def test_a_container_that_cannot_start_is_an_error_not_a_crash(monkeypatch):
    argv = _sandbox_bwrap.bwrap_argv
    broken = lambda *a: argv(*a)[:1] + ["--ro-bind", "/no-such-dir", "/x"] + argv(*a)[1:]
    _sandbox_bwrap.check_usable(_sandbox_bwrap.find_bwrap())  # the one-time probe passes
    monkeypatch.setattr(_sandbox_bwrap, "bwrap_argv", broken)
    with pytest.raises(sandbox.SandboxError, match="before running the program.*no-such-dir"):
        sandbox.run("print(1)", timeout_s=5, memory_mb=256)
    monkeypatch.undo()
    monkeypatch.setenv("POSTTRAIN_SANDBOX_PYTHON", "/usr/bin/no-such-python")
    with pytest.raises(sandbox.SandboxError, match="no-such-python does not exist"):
        sandbox.run("print(1)", timeout_s=5, memory_mb=256)


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="language 'c'"):
        sandbox.run("int main(){}", timeout_s=1, memory_mb=64, language="c")
    with pytest.raises(ValueError, match="relative path"):
        sandbox.run("", timeout_s=1, memory_mb=64, files={"../escape.py": ""})
    with pytest.raises(ValueError, match="backend 'docker'"):
        sandbox.run("", timeout_s=1, memory_mb=64, backend="docker")
