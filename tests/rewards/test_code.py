"""Code reward: program extraction, and the score of correct, partial, crashing, hanging code."""

import pytest

from posttrain.rewards import _sandbox_bwrap
from posttrain.rewards._code import code_reward, code_reward_all_pass, extract_code

requires_bwrap = pytest.mark.skipif(
    _sandbox_bwrap.find_bwrap() is None,
    reason="bubblewrap not installed (apt-get install bubblewrap)",
)

# The problem: read n, then n integers; print their sum.
STDIN_RECORD = {
    "tests": [
        {"stdin": "3\n1 2 3\n", "stdout": "6\n"},
        {"stdin": "1\n10\n", "stdout": "10"},
        {"stdin": "2\n-5 1\n", "stdout": "-4\n"},
        {"input": "3\n-1 -1 -1\n", "output": "  -3  \n\n"},  # spacing is not compared
    ],
    "timeout_s": 1.0,
}
# The same as a function, with assert-style tests.
ASSERT_RECORD = {
    "asserts": [
        "assert total([1, 2, 3]) == 6",
        "assert total([10]) == 10",
        "assert total([-5, 1]) == -4",
        "assert total([-1, -1, -1]) == -3",
    ],
    "timeout_s": 1.0,
}
STDIN_SOLUTIONS = {
    "correct": "input()\nprint(sum(map(int, input().split())))",
    "partial": "input()\nprint(sum(x for x in map(int, input().split()) if x > 0))",
    "crash": "input()\nprint(sum(map(int, input().split())) / 0)",
    "timeout": "while True:\n    pass",
}
ASSERT_SOLUTIONS = {
    "correct": "def total(xs):\n    return sum(xs)",
    "partial": "def total(xs):\n    return sum(x for x in xs if x > 0)",
    "crash": "def total(xs):\n    return sum(xs)\n\nraise RuntimeError('broken at import')",
    "timeout": "def total(xs):\n    while True:\n        pass",
}
EXPECTED = {"correct": (1.0, None), "partial": (0.5, "wrong_answer"), "crash": (0.0, "crash")}
EXPECTED["timeout"] = (0.0, "timeout")


def _completion(code: str) -> str:
    return f"Here is my solution.\n\n```python\n{code}\n```\n\nIt reads the input."


def test_extract_code_takes_the_last_python_block():
    assert extract_code("no code here") is None
    assert extract_code("```python\nunclosed = 1\n") is None
    assert extract_code("```\nplain = 1\n```") == "plain = 1\n"
    two = "```python\nfirst = 1\n```\ntext\n```py\nsecond = 2\n```\nOutput:\n```\n3\n```"
    assert extract_code(two) == "second = 2\n"  # tagged python wins over a later untagged block
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("```python\ns = '```'\nprint(s)\n```") == "s = '```'\nprint(s)\n"


@requires_bwrap
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_stdin_stdout_tests_score_the_passing_fraction(kind):
    score, info = code_reward(STDIN_RECORD, _completion(STDIN_SOLUTIONS[kind]), workers=4)
    assert (score, info["failure"]) == EXPECTED[kind], info
    assert (info["passed"], info["total"]) == (int(4 * EXPECTED[kind][0]), 4)
    if kind == "crash":
        assert "ZeroDivisionError" in info["detail"]


@requires_bwrap
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_assert_tests_score_the_passing_fraction(kind):
    score, info = code_reward(ASSERT_RECORD, _completion(ASSERT_SOLUTIONS[kind]))
    assert (score, info["failure"]) == EXPECTED[kind], info
    assert (info["passed"], info["total"]) == (int(4 * EXPECTED[kind][0]), 4)


@requires_bwrap
def test_all_pass_variant_and_single_test_code():
    partial = _completion(ASSERT_SOLUTIONS["partial"])
    assert code_reward_all_pass(ASSERT_RECORD, partial)[0] == 0.0
    assert code_reward(ASSERT_RECORD, partial, all_pass=True)[0] == 0.0
    assert code_reward_all_pass(ASSERT_RECORD, _completion(ASSERT_SOLUTIONS["correct"]))[0] == 1.0
    record = {"test_code": "assert total([1, 2]) == 3\nassert total([]) == 0"}
    assert code_reward(record, _completion(ASSERT_SOLUTIONS["correct"])) == (
        1.0,
        {"passed": 1, "total": 1, "failure": None},
    )
    setup = {"test_code": "xs = [4, -4]", "asserts": ["assert total(xs) == 0", "assert xs"]}
    assert code_reward(setup, _completion(ASSERT_SOLUTIONS["partial"]))[0] == 0.5


@requires_bwrap
def test_early_exit_and_fake_reports_score_zero():
    for cheat in [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "print('deadbeef 1111')\nexit()",
    ]:
        score, info = code_reward(ASSERT_RECORD, _completion(cheat))
        assert (score, info["failure"]) == (0.0, "crash"), cheat


def test_no_code_and_records_without_tests():
    assert code_reward(STDIN_RECORD, "I cannot solve this.") == (
        0.0,
        {"passed": 0, "total": 4, "failure": "no_code"},
    )
    with pytest.raises(ValueError, match="needs 'tests'"):
        code_reward({"prompt": "x"}, _completion("pass"))
