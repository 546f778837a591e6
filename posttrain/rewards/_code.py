"""Code reward: run the completion's program against the record's tests in the sandbox.

A record carries either stdin/stdout cases, `tests: [{"stdin": ..., "stdout": ...}, ...]` (also
read as "input"/"output"), each run in its own sandbox and passed when the stripped output lines
match; or assert-style tests, `asserts: [...]` (each counted separately) and/or `test_code` (one
test, or setup run before `asserts`), appended after the program and run in one sandbox. The
reward is the fraction of tests passed, or 1/0 for all/not all with `all_pass=True`.

Assert results come back on stdout behind a random per-call nonce printed only after the
asserts ran, so a program that exits early or prints a fake report scores 0. The tests run in
the program's own process, though: a program that deliberately reads its source (or the
harness's frames) can forge the report; stdin/stdout tests have no such gap.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping

import posttrain.rewards.sandbox as sandbox

DEFAULT_TIMEOUT_S = 5.0  # per sandbox run, unless the record has "timeout_s"
DEFAULT_MEMORY_MB = 512  # address space per process
_PYTHON_TAGS = ("python", "py", "python3")
# A fenced block: opening ``` (optional language tag) on its own line, body, closing ``` line.
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
_HARNESS = """

def _posttrain_run_tests(_tests, _nonce):
    import os, sys
    _ok = ""
    for _src in _tests:
        try:
            exec(_src, globals())
            _ok += "1"
        except BaseException:
            _ok += "0"
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os.write(1, ("\\n%s %s\\n" % (_nonce, _ok)).encode())

_posttrain_run_tests({tests!r}, {nonce!r})
"""


def extract_code(completion: str) -> str | None:
    """The program in a completion: its last ```python block, else its last untagged block.

    Blocks tagged with another language (```text, ```bash) and unclosed blocks are ignored.
    Returns None when there is no such block.
    """
    tagged, untagged = [], []
    for tag, body in _FENCE_RE.findall(completion):
        if not body.strip():
            continue
        if tag.lower() in _PYTHON_TAGS:
            tagged.append(body)
        elif not tag:
            untagged.append(body)
    blocks = tagged or untagged
    return blocks[-1] if blocks else None


def code_reward(
    record: Mapping,
    completion: str,
    *,
    timeout_s: float | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    all_pass: bool = False,
    workers: int = 1,
) -> tuple[float, dict]:
    """Scores a completion's program against the record's tests.

    Args:
      record: holds `tests` (stdin/stdout cases) or `asserts` / `test_code`; optional
        `timeout_s` overrides the default per-run timeout.
      completion: the generated text; its program is `extract_code(completion)`.
      timeout_s: wall-clock limit of each sandbox run (one per stdin/stdout case, one for all
        asserts).
      memory_mb: address-space limit per process.
      all_pass: score 1 only if every test passes, else 0.
      workers: stdin/stdout cases run concurrently on this many sandboxes.

    Returns:
      (score, info): info has `passed`, `total` and `failure`: None, "no_code", "timeout",
      "crash" or "wrong_answer" (the first failing test's), plus `detail`, the tail of that
      test's stderr.

    Raises:
      ValueError: the record has no tests.
    """
    cases, asserts, setup = _tests_of(record)
    total = len(cases) if cases is not None else len(asserts)
    info = {"passed": 0, "total": total, "failure": None}
    program = extract_code(completion)
    if program is None:
        info["failure"] = "no_code"
        return 0.0, info
    limits = {"timeout_s": timeout_s or record.get("timeout_s", DEFAULT_TIMEOUT_S)}
    limits["memory_mb"] = memory_mb
    if cases is not None:
        outcomes = _run_cases(program, cases, limits, workers)
    else:
        outcomes = _run_asserts(program, setup, asserts, limits)
    info["passed"] = sum(reason is None for reason, _ in outcomes)
    failed = [(reason, detail) for reason, detail in outcomes if reason is not None]
    if failed:
        info["failure"], info["detail"] = failed[0]
    score = info["passed"] / total
    return (float(score == 1.0) if all_pass else score), info


def code_reward_all_pass(record: Mapping, completion: str, **kwargs) -> tuple[float, dict]:
    """`code_reward` that scores 1 only when every test passes."""
    return code_reward(record, completion, all_pass=True, **kwargs)


def _tests_of(record: Mapping):
    """(stdin/stdout cases or None, assert sources, setup source) of a record."""
    cases = record.get("tests")
    if cases:
        parsed = []
        for case in cases:
            stdin = case.get("stdin", case.get("input"))
            stdout = case.get("stdout", case.get("output"))
            if stdin is None or stdout is None:
                raise ValueError(f"a code test case needs 'stdin' and 'stdout', got {case!r:.200}")
            parsed.append((str(stdin), str(stdout)))
        return parsed, [], ""
    asserts = list(record.get("asserts") or [])
    test_code = record.get("test_code") or ""
    if isinstance(test_code, list):
        asserts, test_code = asserts + test_code, ""
    if not asserts and test_code:
        return None, [test_code], ""
    if not asserts:
        raise ValueError(
            "a code record needs 'tests' (stdin/stdout cases), 'asserts' or 'test_code'; got "
            f"keys {sorted(record)}"
        )
    return None, asserts, test_code


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def _failure(result: sandbox.SandboxResult) -> str | None:
    if result.timed_out:
        return "timeout"
    return None if result.exit_code == 0 else "crash"


def _run_cases(program: str, cases, limits: dict, workers: int) -> list[tuple[str | None, str]]:
    stdins = [stdin for stdin, _ in cases]
    if workers > 1:
        with sandbox.SandboxPool(workers, **limits) as pool:
            results = pool.map([program] * len(cases), stdins=stdins)
    else:
        results = [sandbox.run(program, stdin=stdin, **limits) for stdin in stdins]
    outcomes = []
    for (_, expected), result in zip(cases, results, strict=True):
        reason = _failure(result)
        if reason is None and _lines(result.stdout) != _lines(expected):
            reason = "wrong_answer"
        outcomes.append((reason, result.stderr[-300:]))
    return outcomes


def _run_asserts(program: str, setup: str, asserts: list[str], limits: dict):
    nonce = secrets.token_hex(16)
    tests = asserts if not setup else [setup + "\n" + a for a in asserts]
    result = sandbox.run(program + _HARNESS.format(tests=tests, nonce=nonce), **limits)
    report = None
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            report = line[len(nonce) + 1 :]
    detail = result.stderr[-300:]
    if report is None or len(report) != len(asserts):
        reason = _failure(result) or "crash"  # exited before the report: counts as a crash
        return [(reason, detail or "no test report")] * len(asserts)
    return [(None if ok == "1" else "wrong_answer", detail) for ok in report]
