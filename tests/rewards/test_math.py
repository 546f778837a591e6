"""Math answers: extraction priority, equivalence table through `math_reward`, timeouts."""

import threading
import time

import pytest

from posttrain.rewards import extract_answer, math_equal, math_reward

# (reference answer, completion, verdict, verifier that decides a True verdict). Completions
# reach the answer through every extraction route: \boxed, "####", "the answer is", last number.
TABLE = [
    # Fractions, decimals, roots.
    ("0.5", r"So the probability is \boxed{\frac{1}{2}}.", True, "math_verify"),
    (r"\frac{1}{2}", "Half of it.\n#### 0.5", True, "math_verify"),
    ("1/2", "The answer is 0.5.", True, "math_verify"),
    (r"\frac{1}{2}", r"Halving gives \boxed{\dfrac{1}{2}}", True, "math_verify"),
    ("0.5", "the answer is 1/2 because half of 1 is 1/2", True, "math_verify"),
    (r"-\frac{1}{2}", r"\boxed{-0.5}", True, "math_verify"),
    (r"\frac{5}{6}", "1/2 + 1/3 = 5/6\n#### 5/6", True, "math_verify"),
    (r"\frac{1}{4}", "so the probability is 1/4.", True, "math_verify"),
    ("2", r"\sqrt{4} simplifies, so the answer is $\sqrt{4}$.", True, "math_verify"),
    (r"\sqrt{4}", "We square-root 4 and get 2", True, "math_verify"),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt3}{2}}", True, "math_verify"),
    (r"5\sqrt{2}", r"\boxed{\sqrt{50}}", True, "math_verify"),
    ("1/3", "#### 0.3333333", True, "math_verify"),
    ("1/3", "#### 0.333", False, None),
    (r"\sqrt{2}", "#### 1.414", False, None),
    # Integers: formatting, sign, magnitude.
    (
        "72",
        "Natalia sold 48/2 = 24 clips in May.\nAltogether 48+24 = 72 clips.\n#### 72",
        True,
        "math_verify",
    ),
    ("1000", "#### 1,000", True, "math_verify"),
    ("5", "The answer is 5.0", True, "math_verify"),
    ("7", "The answer is 7 apples.", True, "math_verify"),
    ("3", "**Answer:** 3", True, "math_verify"),
    ("-2", "The answer is \u22122", True, "math_verify"),
    ("10", "There are 10 apples.", True, "math_verify"),
    ("5", r"It costs \boxed{\$5}", True, "math_verify"),
    ("3", r"\boxed{-3}", False, None),
    ("-3", "#### 3", False, None),
    ("10", "The answer is 100.", False, None),
    ("100", r"\boxed{10}", False, None),
    ("12", "I think it's 12 or 13, so 13", False, None),
    # Constants.
    (r"2\pi", r"The circumference is \boxed{2\pi}", True, "math_verify"),
    (r"\pi", r"Answer: \pi", True, "math_verify"),
    (r"\pi", r"\boxed{3.14}", False, None),
    ("3.14", r"The answer is \pi", False, None),
    (r"\infty", r"the limit is \boxed{\infty}", True, "math_verify"),
    # Intervals, sets, tuples.
    ("[0, 1)", r"The solution set is \boxed{[0,1)}", True, "math_verify"),
    ("[0, 1)", r"\boxed{(0,1]}", False, None),
    (r"(-\infty, 3]", r"\boxed{(-\infty,3]}", True, "math_verify"),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", True, "math_verify"),
    (r"\{1,2\}", r"\boxed{\{1,3\}}", False, None),
    ("(1, 2)", r"\boxed{(1,2)}", True, "math_verify"),
    # Equations and expressions.
    ("x=2", r"Solving gives \boxed{2}", True, "math_verify"),
    ("2", r"\boxed{x = 2}", True, "math_verify"),
    ("2", r"\boxed{x=3}", False, None),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", True, "math_verify"),
    ("x^2+2x+1", r"\boxed{(x-1)^2}", False, None),
    # Percentages: math_verify reads "50%" as both 0.5 and 50.
    ("0.25", r"Answer: 25\%", True, "math_verify"),
    (r"50\%", "#### 50", True, "math_verify"),
    (r"50\%", "#### 0.5", True, "math_verify"),
    # Multiple choice.
    (r"\text{(B)}", r"\boxed{B}", True, "math_verify"),
    (r"\text{(B)}", "The answer is (C)", False, None),
    # Plain-text notation math_verify misreads: the sympy fallback decides.
    (r"\frac{\pi}{2}", "the answer is pi/2", True, "sympy"),
    ("1024", "#### 2**10", True, "sympy"),
    ("1000", "The answer is 1e3", True, "sympy"),
    ("2", "The answer is \u221a4", True, "sympy"),
    (r"\infty", "The limit diverges, so the answer is \u221e.", True, "sympy"),
    ("3", "The answer is \u221a4", False, None),
    # Priority: the boxed answer wins over a later "the answer is".
    ("5", r"\boxed{5} is wrong; actually the answer is 6", True, "math_verify"),
    # Garbage and empty.
    ("2", "The answer is garbage", False, None),
    ("2", "", False, None),
    ("2", "I don't know.", False, None),
    (r"\frac{1}{2}", r"\boxed{}", False, None),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{2}", False, None),  # unbalanced: last number "2"
]


def test_table_is_large_and_mixed():
    assert len(TABLE) >= 40
    assert sum(v for _, _, v, _ in TABLE) >= 15 and sum(not v for _, _, v, _ in TABLE) >= 15


@pytest.mark.parametrize("gold,completion,verdict,verifier", TABLE)
def test_math_reward_table(gold, completion, verdict, verifier):
    score, info = math_reward({"answer": gold}, completion)
    assert score == float(verdict), info
    if verdict:
        assert info["verifier"] == verifier, info
    else:
        assert "reason" in info, info


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so \boxed{\frac{1}{2}} and", (r"\frac{1}{2}", "boxed")),
        (r"x \boxed{a{b}c} then \fbox{7}", ("7", "boxed")),
        (r"first \boxed{1}, finally \boxed{\{1, \{2\}\}}", (r"\{1, \{2\}\}", "boxed")),
        (r"\boxed 5$", ("5", "boxed")),
        ("work\n#### 1,234\n", ("1,234", "gsm8k")),
        ("see #### below: the answer is 4", ("4", "answer_is")),  # "####" must start a line
        (r"The answer is $\frac{1}{2}$. Next, 5", (r"\frac{1}{2}", "answer_is")),
        ("the final answer is $$x=2$$ ok", ("x=2", "answer_is")),
        ("Answer: 3.14.", ("3.14", "answer_is")),
        ("I got 3 then 5/6.", ("5/6", "last_number")),
        ("down to -.5", ("-.5", "last_number")),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_failure_reasons():
    assert math_reward({"answer": "2"}, "no idea")[1] == {
        "extracted": None,
        "reason": "no answer found",
    }
    assert math_reward({"answer": "2"}, r"\boxed{}")[1]["reason"] == "empty answer"
    assert math_reward({"answer": "2"}, r"\boxed{3}")[1]["reason"] == "wrong answer"
    bad_reference = math_reward({"answer": r"\frac{"}, "#### 2")[1]
    assert bad_reference["reason"] == "reference answer does not parse"
    with pytest.raises(ValueError, match="no 'answer'"):
        math_reward({"question": "?"}, "2")


def test_math_equal_is_plain_api():
    assert math_equal(r"\frac{1}{2}", "0.5") and not math_equal("1", "2")
    assert math_equal(3, "3.0")  # numeric gold from a dataset


def test_pathological_expressions_are_bounded_in_main_thread():
    start = time.monotonic()
    score, _ = math_reward({"answer": "2"}, r"\boxed{9^{9^{9^{9}}}}", timeout_s=1)
    assert score == 0.0
    score, _ = math_reward({"answer": "2"}, "the answer is 9**9**9**9", timeout_s=1)
    assert score == 0.0
    # Each parse and comparison is bounded by 1 s; a handful of them run.
    assert time.monotonic() - start < 10


def test_works_outside_the_main_thread():
    # math_verify's SIGALRM timeout raises outside the main thread; math_reward switches it off.
    out = []
    thread = threading.Thread(target=lambda: out.append(math_reward({"answer": "1/2"}, "#### 0.5")))
    thread.start()
    thread.join()
    assert out[0][0] == 1.0
