"""The code quality reward: ruff's findings by rule group as components next to the test pass
rate. Fixtures that pass every test with one planted problem lower exactly their component;
suppression comments change nothing; hostile programs and inputs made against the linter stay
contained and score what they earn."""

import os
import shutil
import time

import pytest

from posttrain.rewards import LINT_GROUPS, RewardRegistry, code_quality_reward, lint

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

RECORD = {
    "asserts": [
        "assert mean_of([1, 2, 3]) == 2",
        "assert mean_of([4]) == 4",
        "try:\n    mean_of([])\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError",
    ],
    "timeout_s": 2,
}
CLEAN = '''
def mean_of(values):
    """The arithmetic mean of `values`; ValueError when there are none."""
    if not values:
        raise ValueError("no values to average")
    return sum(values) / len(values)
'''
# Each passes every test with problems of one group only (and how many findings it plants).
PLANTED = {
    "naming": (
        '''
def MeanOf(Values):
    """The arithmetic mean of `Values`; ValueError when there are none."""
    l = len(Values)
    if not l:
        raise ValueError("no values to average")
    return sum(Values) / l


mean_of = MeanOf
''',
        3,
    ),  # N802 function name, N803 argument name, E741 the name `l`
    "docs": (
        """
def mean_of(values):
    if not values:
        raise ValueError("no values to average")
    return sum(values) / len(values)
""",
        1,
    ),  # D103
    "errors": (
        '''
def mean_of(values):
    """The arithmetic mean of `values`; ValueError when there are none."""
    try:
        return sum(values) / len(values)
    except:
        raise ValueError("no values to average")
''',
        2,
    ),  # E722 bare except, B904 the cause dropped
    "complexity": (
        '''
def mean_of(values):
    """The arithmetic mean of `values`; ValueError when there are none."""
    n = len(values)
'''
        + "".join(f"    if n == {k}:\n        return sum(values) / {k}\n" for k in range(1, 13))
        + """    if n == 0:
        raise ValueError("no values to average")
    return sum(values) / n
""",
        3,
    ),  # C901 complexity 14 > 10, PLR0911 13 returns > 6, PLR0912 14 branches > 12
    "hygiene": (
        '''
import os
import sys


def mean_of(values):
    """The arithmetic mean of `values`; ValueError when there are none."""
    unused = os.sep
    if not values:
        raise ValueError("no values to average")
    return sum(values) / len(values)
''',
        2,
    ),  # F401 `sys` unused, F841 the local `unused`
}


def _answer(program: str) -> str:
    return f"Here it is:\n```python\n{program}```\n"


def test_a_clean_solution_scores_one_on_every_component():
    score, info = code_quality_reward(RECORD, _answer(CLEAN))
    assert info["passed"] == 3 and info["lint"] == dict.fromkeys(LINT_GROUPS, 0), info
    assert info["components"] == {"tests": 1.0, **dict.fromkeys(LINT_GROUPS, 1.0)}
    assert score == 1.0


@pytest.mark.parametrize("group", list(PLANTED))
def test_a_planted_problem_lowers_exactly_its_component(group):
    program, findings = PLANTED[group]
    score, info = code_quality_reward(RECORD, _answer(program))
    assert info["passed"] == 3, info  # the tests pass: only quality differs
    expected = {"tests": 1.0, **dict.fromkeys(LINT_GROUPS, 1.0), group: 1 / (1 + findings)}
    assert info["components"] == expected, info["lint"]
    # By the default weights: tests 1, each group 0.1.
    assert score == pytest.approx((1 + 0.1 * (len(LINT_GROUPS) - 1) + 0.1 / (1 + findings)) / 1.5)
    # Suppression comments are ignored: the same findings with one on every line and one for
    # the whole file (spelt in parts, so that this file's own lint does not read them).
    noqa = "# " + "noqa"
    muted = (
        "# ruff: "
        + "noqa\n"
        + "".join(
            f"{line}  {noqa}\n" if line.strip() and not line.startswith(" " * 8) else line + "\n"
            for line in program.split("\n")
        )
    )
    assert code_quality_reward(RECORD, _answer(muted))[1]["components"] == expected


def test_lint_counts_only_as_far_as_the_tests_pass():
    wrong = CLEAN.replace("sum(values) / len(values)", "sum(values)")  # passes 2 of 3
    score, info = code_quality_reward(RECORD, _answer(wrong))
    assert info["components"]["tests"] == pytest.approx(2 / 3) and info["lint"]["naming"] == 0
    assert score == pytest.approx(2 / 3 * (1 + 0.5) / 1.5)
    assert code_quality_reward(RECORD, "no code at all") == (
        0.0, {"passed": 0, "total": 3, "failure": "no_code",
              "components": {"tests": 0.0, **dict.fromkeys(LINT_GROUPS, 0.0)}},
    )  # fmt: skip


def test_weights_come_from_the_reference_options():
    registry = RewardRegistry()
    tests_only = "posttrain.rewards:code_quality_reward?" + "&".join(f"{g}=0" for g in LINT_GROUPS)
    registry.register("code_quality", tests_only)
    registry.register("naming_only", "posttrain.rewards:code_quality_reward?tests=0&naming=1"
                      + "".join(f"&{g}=0" for g in LINT_GROUPS if g != "naming"))  # fmt: skip
    naming = _answer(PLANTED["naming"][0])
    assert registry.score(RECORD, naming, "code_quality")[0] == 1.0
    assert registry.score(RECORD, naming, "naming_only")[0] == 0.25
    registry.register("typo", "posttrain.rewards:code_quality_reward?namings=1")
    with pytest.raises(ValueError, match=r"typo/code_quality_reward .*no such options \['namings'"):
        registry.check(["typo"])


HOSTILE = {
    # What tests/rewards/test_sandbox.py's hostile programs do, as the solution itself.
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "infinite loop": "while True:\n    pass\n",
    "memory": "x = bytearray(10 << 30)\n",
    "escape": "open('/work/escaped', 'w').write('x')\nimport socket\n"
    "socket.create_connection(('1.1.1.1', 80), timeout=1)\n",
    # Made against the linter: nesting past its parser's limits, a huge file, a config file's
    # directives in the source.
    "deep nesting": "x = " + "(" * 20000 + "1" + ")" * 20000 + "\n",
    "huge": "x = 1\n" * 400_000,
    "pyproject": "# /// script\n# [tool.ruff]\n# select = []\n# ///\nimport os\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_programs_stay_contained(name, tmp_path):
    start = time.monotonic()
    score, info = code_quality_reward(RECORD, _answer(HOSTILE[name]))
    assert score == 0.0 and info["components"]["tests"] == 0.0, info  # they pass no test
    assert not os.path.exists("/work/escaped")
    assert time.monotonic() - start < 60
    if name == "pyproject":  # the unused import still counts
        assert info["lint"]["hygiene"] == 1, info
    if "lint_failure" in info:  # the linter gave up: no lint credit, and why
        assert set(info["components"].values()) == {0.0}
        assert info["lint_failure"].startswith(("lint_timeout", "lint_crash", "syntax_error"))


def test_lint_reports_findings_by_group():
    counts, failure = lint(PLANTED["errors"][0])
    assert failure is None and counts == {**dict.fromkeys(LINT_GROUPS, 0), "errors": 2}
    counts, failure = lint("def f(:\n")  # a program that does not parse earns nothing
    assert counts == {} and failure.startswith("syntax_error"), failure
    counts, failure = lint(CLEAN, timeout_s=0.001)  # a linter that cannot finish: nothing
    assert (counts, failure) == ({}, "lint_timeout")
