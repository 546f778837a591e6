"""The terminal environment: the model works on a task's files with a sandboxed shell, and the
task's hidden tests score what it leaves in its workspace.

A record:

    {"prompt": "Fix `add` in calc.py so that its tests pass.",   # text or messages
     "files": {"calc.py": "def add(a, b):\\n    return a - b\\n"},  # the starting workspace
     "tests": [{"name": "small", "code": "from calc import add\\nassert add(2, 3) == 5"}]}

Each episode gets a fresh host directory (`sandbox.make_workspace`) holding `files`; the tools
`bash`, `read_file` and `write_file` each run in a fresh sandbox container with it bound at
`/workspace`, so files persist across calls and nothing else does (no process outlives a call,
no network, the host invisible). The turn without tool calls ends the episode; then each test
runs, as a Python program in its own sandbox (its code in the container's /tmp, never seen by the
model) with `/workspace` as working directory and last on `sys.path`. A test passes when it runs
to its end: exit status 0 and a line the runner prints after its last statement, so a model's
module that calls `sys.exit(0)` or `os._exit(0)` when imported fails the test, not passes it.
Tests are plain scripts of asserts (one that calls `sys.exit`, like `unittest.main()`, fails).

reward = passed / total - format_penalty * (turns with calls that failed to parse)
         - turn_penalty * max(0, turns - free_turns)

`read_file` and `write_file` run in the sandbox too (about 30 ms a call) rather than on the host:
the workspace is the model's, symlinks included, and the host side runs as root; in the
container a symlink to `/etc/passwd` or to the workspace's host path resolves to nothing of the
host, and the files it writes belong to the sandbox's uid.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import secrets
import shlex
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from posttrain.envs._base import Step, Tool, ToolEnvironment, prompt_messages, register_env
from posttrain.rewards import sandbox

WORKSPACE = "/workspace"  # where the model sees its workspace
SYSTEM = """\
You are working in a Linux shell on the files of a task, in the directory {workspace}. Tools:
- bash(command): runs a bash command in {workspace} and returns its exit code, stdout and \
stderr. Each call is a fresh shell: files persist across calls, processes, variables and `cd` \
do not. No network. A call is killed after {timeout_s:g} s; output is cut after {cap} bytes.
- read_file(path): returns a file's text.
- write_file(path, content): writes a file (creating its directories), replacing it.
Paths are relative to {workspace}. When you are done, answer with a message without tool \
calls: that ends the episode, and hidden tests then check the files in {workspace}."""


@dataclass(frozen=True)
class TerminalOptions:
    """How a terminal episode runs and is scored (`make_env("terminal", record, **fields)`)."""

    timeout_s: float = 10.0  # wall-clock limit of each tool call and of each hidden test
    memory_mb: int = 512  # address space of each process in the sandbox
    max_output_bytes: int = 8192  # kept of a call's stdout and of its stderr, and of read_file
    max_procs: int = 64  # processes and threads at once in one call's sandbox
    file_size_mb: int = 16  # largest file a call may write
    workspace_mb: int = 256  # past this total size, every call's answer says to delete files
    format_penalty: float = 0.0  # per turn with a tool call that failed to parse
    turn_penalty: float = 0.0  # per turn beyond free_turns
    free_turns: int = 10  # turns (model messages, the last included) without turn_penalty
    workspace_root: str | None = None  # where workspaces are made (None: the system temp dir)
    backend: str | None = None  # sandbox backend (None: POSTTRAIN_SANDBOX, else bwrap)


class TerminalEnvironment(ToolEnvironment):
    """One episode of a terminal task: `reset()` makes the workspace, `close()` deletes it.

    Args:
      record: {"prompt", "files" (optional), "tests": [{"name", "code"}, ...]}.
      options: limits and penalties.
    """

    def __init__(self, record: Mapping[str, Any], options: TerminalOptions | None = None):
        self.options = options = options or TerminalOptions()
        system = SYSTEM.format(
            workspace=WORKSPACE, timeout_s=options.timeout_s, cap=options.max_output_bytes
        )
        tools = [Tool(self.bash), Tool(self.read_file), Tool(self.write_file)]
        super().__init__(record, tools, system)
        self.tests = _check_tests(record.get("tests"))
        files = record.get("files") or {}
        if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            raise ValueError("a terminal record's 'files' is a {relative path: text} mapping")
        self.workspace: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._fault: Exception | None = None
        self.turns = self.bad_turns = 0
        self.done = False

    # -- the episode ---------------------------------------------------------------------------

    def reset(self) -> list[dict]:
        self.close()
        o = self.options
        self.workspace = sandbox.make_workspace(self.record.get("files"), o.workspace_root)
        # Deleted at close(), or when the environment is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, sandbox.remove_workspace, self.workspace)
        self.turns = self.bad_turns = 0
        self.done = False
        return prompt_messages(self.record, self.system)

    def step(self, message: dict) -> Step:
        if self.workspace is None or self.done:
            raise RuntimeError("terminal episode: call reset() before step(), and not after done")
        self.turns += 1
        self.bad_turns += bool(message.get("tool_call_errors"))
        step = super().step(message)
        if not step.done:
            return step
        self.done = True
        passed = self.run_tests()
        o = self.options
        reward = (
            sum(passed.values()) / len(passed)
            - o.format_penalty * self.bad_turns
            - o.turn_penalty * max(0, self.turns - o.free_turns)
        )
        info = {
            **step.info,
            "tests_passed": sum(passed.values()),
            "tests_total": len(passed),
            "tests": passed,
            "turns": self.turns,
            "format_error_turns": self.bad_turns,
        }
        return Step([], reward, True, info)

    def call(self, call: Mapping[str, Any]) -> tuple[str, bool]:
        # A fault of the sandbox, the machine or the options is no tool error of the model's:
        # the step raises it, as a hidden test run that cannot start does.
        content, ok = super().call(call)
        if self._fault is not None:
            fault, self._fault = self._fault, None
            raise fault
        return content, ok

    def run_tests(self) -> dict[str, bool]:
        """{test name: passed} for the workspace as it is now."""
        passed = {}
        for test in self.tests:
            marker = f"posttrain-test-end-{secrets.token_hex(8)}"
            result = self._run(f"{test['code']}\nprint({marker!r})\n", "python")
            last = result.stdout.rstrip("\n").rpartition("\n")[2]
            passed[test["name"]] = result.ok and last == marker
        return passed

    def close(self) -> None:
        """Deletes the workspace; idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self.workspace = self._finalizer = None

    def __enter__(self) -> TerminalEnvironment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the tools -----------------------------------------------------------------------------

    def bash(self, command: str) -> str:
        """Runs a bash command in the workspace, in a fresh sandboxed shell.

        Args:
            command: The bash command or script to run.
        """
        r = self._run(command, "bash")
        cap = self.options.max_output_bytes
        if r.timed_out:
            status = f"timed out after {self.options.timeout_s:g} s (killed)"
        elif r.killed_by_signal:
            status = f"killed by signal {r.killed_by_signal}"
        else:
            status = f"exit code: {r.exit_code}"
        parts = [status]
        for name, text, cut in (
            ("stdout", r.stdout, r.stdout_truncated),
            ("stderr", r.stderr, r.stderr_truncated),
        ):
            if text or cut:
                note = f" (truncated to {cap} bytes)" if cut else ""
                parts.append(f"{name}{note}:\n{text}")
        return "\n".join(parts) + self._quota_note()

    def read_file(self, path: str) -> str:
        """Returns the text of a file in the workspace.

        Args:
            path: The file's path, relative to the workspace.
        """
        r = self._run(f"exec cat -- {shlex.quote(self._path(path))}", "bash")
        if not r.ok:
            raise OSError(r.stderr.strip() or f"cannot read {path}")
        if r.stdout_truncated:
            cap = self.options.max_output_bytes
            return (
                f"{r.stdout}\n[the file is longer: cut after {cap} bytes; read the rest with bash]"
            )
        return r.stdout

    def write_file(self, path: str, content: str) -> str:
        """Writes a text file in the workspace, replacing it, creating its directories.

        Args:
            path: The file's path, relative to the workspace.
            content: The file's whole new text.
        """
        rel = shlex.quote(self._path(path))
        r = self._run(f'mkdir -p -- "$(dirname -- {rel})" && cat > {rel}', "bash", stdin=content)
        if not r.ok:
            raise OSError(r.stderr.strip() or f"cannot write {path}")
        return f"wrote {len(content.encode())} bytes to {path}" + self._quota_note()

    # -- helpers -------------------------------------------------------------------------------

    def _run(self, code: str, language: str, stdin: str = "") -> sandbox.SandboxResult:
        o = self.options
        try:
            return sandbox.run(
                code,
                stdin=stdin,
                timeout_s=o.timeout_s,
                memory_mb=o.memory_mb,
                language=language,
                workspace=self.workspace,
                max_procs=o.max_procs,
                max_output_bytes=o.max_output_bytes,
                file_size_mb=o.file_size_mb,
                backend=o.backend,
            )
        except Exception as e:  # the sandbox or its options, never the model's code
            self._fault = e  # for call(): the tool's own error handling would hide it
            raise

    def _path(self, path: str) -> str:
        """`path` relative to the workspace; ValueError if it points outside."""
        rel = path
        if posixpath.isabs(path):
            rel = posixpath.relpath(posixpath.normpath(path), WORKSPACE)
        norm = posixpath.normpath(rel)
        if norm.split("/")[0] == ".." or norm == ".":
            raise ValueError(f"{path!r} is not a file inside {WORKSPACE}")
        return norm

    def _quota_note(self) -> str:
        size = _tree_bytes(self.workspace)
        if size <= self.options.workspace_mb << 20:
            return ""
        return (
            f"\nError: the workspace holds {size >> 20} MB, over its {self.options.workspace_mb}"
            " MB limit: delete files."
        )


def _tree_bytes(path: str) -> int:
    """Bytes in the files under path (symlinks not followed)."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


def _check_tests(tests: Any) -> list[dict]:
    if (
        not isinstance(tests, list)
        or not tests
        or not all(isinstance(t, Mapping) and isinstance(t.get("code"), str) for t in tests)
    ):
        raise ValueError(
            "a terminal record needs 'tests': a non-empty list of {'name': str, 'code': str} "
            f"(each a Python test program), got {tests!r:.120}"
        )
    names = [str(t.get("name", i)) for i, t in enumerate(tests)]
    if len(set(names)) != len(names):
        raise ValueError(f"a terminal record's test names must be unique, got {names}")
    return [{"name": n, "code": t["code"]} for n, t in zip(names, tests, strict=True)]


def terminal_tasks() -> list[dict]:
    """The bundled task set (`assets/terminal_tasks.jsonl`): records with "id", "prompt",
    "files", hidden "tests", and a "solution" (tool calls `{"name", "arguments"}` that solve it)."""
    text = resources.files("posttrain.envs").joinpath("assets/terminal_tasks.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def make_terminal_env(record: Mapping[str, Any], **options: Any) -> TerminalEnvironment:
    """`make_env("terminal", record, **options)`: options are `TerminalOptions` fields."""
    fields = {f.name for f in dataclasses.fields(TerminalOptions)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown terminal environment options {unknown}; known: {sorted(fields)}")
    return TerminalEnvironment(record, TerminalOptions(**options))


register_env("terminal", make_terminal_env, rewards=True)
