"""Code quality beyond passing tests: lint findings by kind, as reward components.

`code_quality_reward` scores a completion's program on the record's tests (`code_reward`) and
lints it with `ruff` inside the sandbox (the program is only read, never run, by the linter;
ruff's binary is bound read-only into the container). Each rule group below is a component,
1 / (1 + findings of that group): 1 for a clean program, 0.5 for one finding, ... The total is

    (w_tests * tests + tests * sum(w_g * group_g)) / (w_tests + sum(w_g))

so the lint terms count only as far as the tests pass: a program that passes nothing scores 0
however clean it is, and an empty answer never earns lint credit. Suppression comments
(`# noqa`, `# ruff: noqa`) are ignored and no configuration file is read.

Weights come in config as options of the reference, e.g.
`"posttrain.rewards:code_quality_reward?naming=0.2&complexity=0"` (`RewardRegistry`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Mapping

import posttrain.rewards.sandbox as sandbox
from posttrain.rewards._code import DEFAULT_MEMORY_MB, code_reward, extract_code

# Rule groups (ruff codes or prefixes); a finding counts in the first group whose code matches.
LINT_GROUPS: dict[str, tuple[str, ...]] = {
    # pep8-naming, and names easy to misread (l, O, I)
    "naming": ("N", "E741", "E742", "E743"),
    # public modules' functions, classes and methods without a docstring, or an empty one
    "docs": ("D101", "D102", "D103", "D419"),
    # bare or blind excepts, swallowed errors, vague raises, lost causes
    "errors": ("E722", "BLE001", "S110", "S112", "TRY002", "TRY203", "B904"),
    # McCabe complexity over 10, too many branches, returns, statements or arguments
    "complexity": ("C901", "PLR0911", "PLR0912", "PLR0913", "PLR0915"),
    # pyflakes: unused imports and variables, undefined names, redefinitions
    "hygiene": ("F",),
}
LINT_TIMEOUT_S = 10.0
LINT_MEMORY_MB = 512
_SCRIPT = (
    "RAYON_NUM_THREADS=1 exec ruff check --isolated --no-cache --ignore-noqa --exit-zero "
    "--output-format=json --target-version=py311 --config 'lint.mccabe.max-complexity = 10' "
    "--select={rules} --stdin-filename=solution.py -"
)


@functools.cache
def ruff_binary() -> str:
    """The ruff executable: `POSTTRAIN_RUFF`, else the `ruff` package's, else ruff on PATH.

    Raises:
      RuntimeError: none is installed (the message says how to install it).
    """
    path = os.environ.get("POSTTRAIN_RUFF")
    if not path:
        try:
            from ruff.__main__ import find_ruff_bin

            path = find_ruff_bin()
        except (ImportError, FileNotFoundError):
            path = shutil.which("ruff")
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(
            "the code quality reward lints with ruff, which is not installed: "
            "pip install 'posttrain[quality]' (or ruff), or set POSTTRAIN_RUFF to its binary"
        )
    return path


def lint(program: str, *, timeout_s: float = LINT_TIMEOUT_S) -> tuple[dict[str, int], str | None]:
    """Findings per group of `LINT_GROUPS` in `program`, and why linting failed (None if it did
    not: then the counts are the findings, else they are empty): "lint_timeout", "lint_crash"
    or "syntax_error" (the program does not parse)."""
    rules = ",".join(code for codes in LINT_GROUPS.values() for code in codes)
    result = sandbox.run(
        _SCRIPT.format(rules=rules), stdin=program, language="bash", timeout_s=timeout_s,
        memory_mb=LINT_MEMORY_MB, tools={"ruff": ruff_binary()},
    )  # fmt: skip
    if result.timed_out:
        return {}, "lint_timeout"
    try:
        findings = json.loads(result.stdout)
    except ValueError:
        return {}, f"lint_crash: {result.stderr[-300:]}"
    counts = dict.fromkeys(LINT_GROUPS, 0)
    for finding in findings:
        code = finding.get("code")
        if code in (None, "", "E999", "invalid-syntax"):  # a syntax error: nothing to credit
            return {}, f"syntax_error: {str(finding.get('message'))[:200]}"
        group = next((g for g, codes in LINT_GROUPS.items() if code.startswith(codes)), None)
        if group is not None:
            counts[group] += 1
    return counts, None


def code_quality_reward(
    record: Mapping,
    completion: str,
    *,
    tests: float = 1.0,
    naming: float = 0.1,
    docs: float = 0.1,
    errors: float = 0.1,
    complexity: float = 0.1,
    hygiene: float = 0.1,
    timeout_s: float | None = None,
    memory_mb: int = DEFAULT_MEMORY_MB,
    workers: int = 1,
) -> tuple[float, dict]:
    """The test pass rate with lint components (module docstring).

    Args:
      record: as `code_reward`'s (tests or asserts).
      completion: the generated text; its program is `extract_code(completion)`.
      tests, naming, docs, errors, complexity, hygiene: the weights of the pass rate and of
        each group of `LINT_GROUPS`.
      timeout_s, memory_mb, workers: how the tests run (`code_reward`).

    Returns:
      (total, info): `code_reward`'s info, plus `components` ({"tests", *LINT_GROUPS}: each in
      [0, 1]), `lint` (findings per group) and `lint_failure` when the linter did not finish
      (its components are then 0).

    Raises:
      ValueError: a negative weight, or all weights 0.
    """
    weights = dict(naming=naming, docs=docs, errors=errors, complexity=complexity,
                   hygiene=hygiene)  # fmt: skip
    if min(tests, *weights.values()) < 0 or not tests + sum(weights.values()) > 0:
        raise ValueError(f"code quality weights must be >= 0, not all 0: {weights}, {tests=}")
    passed, info = code_reward(record, completion, timeout_s=timeout_s, memory_mb=memory_mb,
                               workers=workers)  # fmt: skip
    components = {"tests": passed, **dict.fromkeys(LINT_GROUPS, 0.0)}
    program = extract_code(completion)
    if program is not None:
        counts, failure = lint(program)
        info["lint"] = counts
        if failure:
            info["lint_failure"] = failure
        for group, n in counts.items():
            components[group] = 1.0 / (1.0 + n)
    info["components"] = components
    # (summed in one order, so that a clean, passing program scores exactly 1)
    lint_part = sum(weights[g] * components[g] for g in LINT_GROUPS)
    total = passed * (tests + lint_part) / (tests + sum(weights[g] for g in LINT_GROUPS))
    return total, info
