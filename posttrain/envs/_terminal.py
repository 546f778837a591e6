"""The terminal environment: the model works on a task's files with a sandboxed shell, and the
task's hidden tests score what it leaves in its workspace.

A record:

    {"prompt": "Fix `add` in calc.py so that its tests pass.",   # text or messages
     "files": {"calc.py": "def add(a, b):\\n    return a - b\\n"},  # the starting workspace
     "tests": [{"name": "small", "code": "from calc import add\\nassert add(2, 3) == 5"}]}

What the policy cannot get around (`tests/envs/test_terminal.py` tries each way):

- Each tool call (`bash`, `read_file`, `write_file`) is one sandbox run (`sandbox.run` with the
  episode's `sandbox.Workspace`): the workspace is unpacked into a fresh tmpfs at `/workspace`
  of `workspace_mb` and `workspace_files` inodes, so a write past either fails inside with
  ENOSPC; nothing but its archive (at most that much) reaches the host. When the call's shell
  exits, or at `timeout_s` (or when the episode's `max_tool_s` runs out), every process it
  started is killed, and only then is the workspace packed back: no process outlives a call.
- The hidden tests run after the last turn, each in a fresh sandbox with the workspace mounted
  read-only, and never enter a sandbox the policy's commands run in. A test is scored by the
  exit status of its runner (`assets/terminal_test_runner.py`), a trusted process that imports
  no workspace file: the workspace's modules a test imports run in a process of their own and
  return plain data only, so printing a marker, exiting with status 0, hooking the interpreter
  (`sitecustomize.py`, `.pth`, `atexit`, `sys.excepthook`), patching builtins or returning an
  object equal to everything cannot pass a test. There is no end-of-test marker to read.

reward = passed / total - format_penalty * (turns with calls that failed to parse)
         - turn_penalty * max(0, turns - free_turns)

A test is a Python script of asserts, run with `/workspace` as its working directory, the
standard library and the system's site-packages; its own `import` statements that name a module
of the workspace (no standard or installed module's name) work as the proxy above says; it
writes in `/tmp`, never the workspace; it may run the workspace's scripts with `subprocess`.
It passes when it runs to its end (or calls `sys.exit(0)`, as `unittest.main()` does on
success).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import posixpath
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
stderr. Each call is a fresh shell: files in {workspace} persist across calls; processes, \
variables, `cd` and /tmp do not. No network. A call is stopped after {timeout_s:g} s, with \
every process it started; output is cut after {cap} bytes. {workspace} holds at most \
{workspace_mb} MB in {workspace_files} files and directories.
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
    workspace_mb: int = 256  # the workspace's tmpfs size: a write past it fails (ENOSPC)
    workspace_files: int = 10_000  # files, directories and links the workspace may hold
    max_tool_s: float | None = None  # tool seconds per episode, calls stopped when spent
    format_penalty: float = 0.0  # per turn with a tool call that failed to parse
    turn_penalty: float = 0.0  # per turn beyond free_turns
    free_turns: int = 10  # turns (model messages, the last included) without turn_penalty
    workspace_root: str | None = None  # where workspace archives live (None: system temp dir)
    backend: str | None = None  # sandbox backend: bwrap only (None: POSTTRAIN_SANDBOX, bwrap)


class TerminalEnvironment(ToolEnvironment):
    """One episode of a terminal task: `reset()` makes the workspace, `close()` deletes it.

    Args:
      record: {"prompt", "files" (optional), "tests": [{"name", "code"}, ...]}.
      options: limits and penalties.
    """

    def __init__(self, record: Mapping[str, Any], options: TerminalOptions | None = None):
        self.options = options = options or TerminalOptions()
        if options.max_tool_s is not None and options.max_tool_s <= 0:
            raise ValueError(f"terminal max_tool_s must be positive, got {options.max_tool_s}")
        system = SYSTEM.format(
            workspace=WORKSPACE,
            timeout_s=options.timeout_s,
            cap=options.max_output_bytes,
            workspace_mb=options.workspace_mb,
            workspace_files=options.workspace_files,
        )
        tools = [Tool(self.bash), Tool(self.read_file), Tool(self.write_file)]
        super().__init__(record, tools, system)
        self.tests = _check_tests(record.get("tests"))
        files = record.get("files") or {}
        if not isinstance(files, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            raise ValueError("a terminal record's 'files' is a {relative path: text} mapping")
        self.workspace: sandbox.Workspace | None = None
        self._finalizer: weakref.finalize | None = None
        self._fault: Exception | None = None
        self.turns = self.bad_turns = 0
        self.tool_s = 0.0  # sandbox seconds the episode's tool calls took
        self.done = False

    # -- the episode ---------------------------------------------------------------------------

    def reset(self) -> list[dict]:
        self.close()
        o = self.options
        self.workspace = sandbox.make_workspace(
            self.record.get("files"),
            o.workspace_root,
            size_mb=o.workspace_mb,
            max_files=o.workspace_files,
        )
        # Deleted at close(), or when the environment is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, sandbox.remove_workspace, self.workspace)
        self.turns = self.bad_turns = 0
        self.tool_s = 0.0
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
        """{test name: passed} for the workspace as it is now: each test in a fresh sandbox
        with the workspace read-only, passed when its runner exits with status 0."""
        passed = {}
        for test in self.tests:
            r = self._run(_runner(), "python", stdin=test["code"], readonly=True)
            if r.exit_code == _RUNNER_SETUP_FAILED:
                raise sandbox.SandboxError(f"the hidden-test runner failed: {r.stderr[-500:]}")
            passed[test["name"]] = r.ok
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
        limit = self._budget_left()
        r = self._tool(command)
        cap = self.options.max_output_bytes
        if r.timed_out:
            status = f"timed out after {limit:.3g} s: stopped, with every process it started"
            if self._budget_left() <= 0:
                status += f" (the episode's tool time, {self.options.max_tool_s:g} s, is spent)"
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
        if r.workspace_error:
            parts.append(f"Error: {r.workspace_error}; the workspace is as before this call.")
        return "\n".join(parts)

    def read_file(self, path: str) -> str:
        """Returns the text of a file in the workspace.

        Args:
            path: The file's path, relative to the workspace.
        """
        r = self._tool(f"exec cat -- {shlex.quote(self._path(path))}")
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
        r = self._tool(f'mkdir -p -- "$(dirname -- {rel})" && cat > {rel}', stdin=content)
        if not r.ok or r.workspace_error:
            raise OSError(r.workspace_error or r.stderr.strip() or f"cannot write {path}")
        return f"wrote {len(content.encode())} bytes to {path}"

    # -- helpers -------------------------------------------------------------------------------

    def _tool(self, command: str, stdin: str = "") -> sandbox.SandboxResult:
        """Runs a tool's bash command, within what is left of the episode's tool time."""
        if self._budget_left() <= 0:
            raise TimeoutError(
                f"the episode's tool time ({self.options.max_tool_s:g} s) is spent: answer now"
            )
        r = self._run(command, "bash", stdin=stdin, timeout_s=self._budget_left())
        self.tool_s += r.wall_s
        return r

    def _budget_left(self) -> float:
        o = self.options
        return o.timeout_s if o.max_tool_s is None else min(o.timeout_s, o.max_tool_s - self.tool_s)

    def _run(
        self,
        code: str,
        language: str,
        stdin: str = "",
        readonly: bool = False,
        timeout_s: float | None = None,
    ) -> sandbox.SandboxResult:
        o = self.options
        try:
            return sandbox.run(
                code,
                stdin=stdin,
                timeout_s=timeout_s or o.timeout_s,
                memory_mb=o.memory_mb,
                language=language,
                workspace=self.workspace,
                workspace_readonly=readonly,
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


_RUNNER_SETUP_FAILED = 99  # the runner's status when it could not set itself up


@functools.cache
def _runner() -> str:
    """The hidden tests' runner (`assets/terminal_test_runner.py`)."""
    files = resources.files("posttrain.envs")
    return files.joinpath("assets/terminal_test_runner.py").read_text()


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
    for name, t in zip(names, tests, strict=True):
        try:
            compile(t["code"], f"<test {name}>", "exec")
        except SyntaxError as e:
            raise ValueError(f"a terminal record's test {name!r} is not valid Python: {e}") from e
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


register_env("terminal", make_terminal_env, rewards=True, tool_budget=True)
