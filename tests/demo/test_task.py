"""The demo task: problem format, deterministic disjoint datasets, and the verifier."""

import random
import re
from collections import Counter

import pytest

from posttrain.demo import extract_answer, is_correct, make_dataset, make_problem, problem_key


def test_problem_format():
    record = make_problem(random.Random(0))
    assert set(record) == {"messages", "prompt", "answer", "domain"}
    user, assistant = record["messages"]
    assert record["prompt"] == [user] and record["domain"] == "arithmetic"
    assert user["role"] == "user" and assistant == {
        "role": "assistant",
        "content": record["answer"],
    }
    match = re.fullmatch(r"What is ([0-9]+) ([+-]) ([0-9]+)\?", user["content"])
    a, op, b = int(match[1]), match[2], int(match[3])
    assert (a, op, b) == problem_key(record)
    assert record["answer"] == str(a + b if op == "+" else a - b)


@pytest.mark.parametrize("max_digits", [1, 2, 4])
def test_max_digits(max_digits):
    records = make_dataset(150, seed=3, max_digits=max_digits)
    keys = [problem_key(r) for r in records]
    assert all(0 <= a < 10**max_digits and 0 <= b < 10**max_digits for a, _, b in keys)
    # Operand lengths are drawn uniformly, so every length shows up.
    assert {len(str(a)) for a, _, _ in keys} == set(range(1, max_digits + 1))


def test_dataset_deterministic_and_distinct():
    records = make_dataset(3000, seed=7)
    assert records == make_dataset(3000, seed=7)
    assert records != make_dataset(3000, seed=8)
    assert len({problem_key(r) for r in records}) == 3000


def test_exclude_keeps_held_out_disjoint():
    held_out = make_dataset(500, seed=0)
    train = make_dataset(5000, seed=0, exclude=held_out)  # same seed: overlap is likely
    assert not {problem_key(r) for r in train} & {problem_key(r) for r in held_out}
    by_key = make_dataset(5000, seed=0, exclude=[problem_key(r) for r in held_out])
    assert by_key == train


def test_dataset_exhausts_small_spaces():
    everything = make_dataset(200, seed=0, max_digits=1)  # all 10 * 10 * 2 one-digit problems
    assert len({problem_key(r) for r in everything}) == 200
    with pytest.raises(ValueError, match="cannot draw 101 distinct problems"):
        make_dataset(101, seed=0, max_digits=1, exclude=everything[:100])
    with pytest.raises(ValueError, match="max_digits"):
        make_dataset(10, seed=0, max_digits=0)


def test_answer_distribution():
    records = make_dataset(5000, seed=1)
    ops = Counter(problem_key(r)[1] for r in records)
    assert 0.45 < ops["+"] / len(records) < 0.55
    negative = sum(r["answer"].startswith("-") for r in records)
    assert 0.15 < negative / len(records) < 0.35  # about half of the differences
    lengths = Counter(len(r["answer"].lstrip("-")) for r in records)
    assert set(lengths) == {1, 2, 3, 4}
    assert all(is_correct(r["answer"], r) for r in records)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("936", "936"),
        (" 936 ", "936"),
        ("\n936\n", "936"),
        ("-12", "-12"),
        ("The answer is 936", "936"),
        ("The answer is 936.", "936"),
        ("936<|im_end|>", "936"),
        ("936<|im_end|>\n<|im_start|>user\n5", "936"),
        ("936<|endoftext|><|endoftext|>", "936"),
        ("347 - 589 = -242", "-242"),
        ("\u2212242", "-242"),
        ("+7", "7"),
        ("0936", "936"),
        ("-0", "0"),
        ("1,998", "1998"),
        ("936.0", "936"),
        ("5-3", "3"),  # a minus between numbers is an operator, not a sign
        ("93 6", None),
        ("9 3 6", None),
        ("936.5", None),
        ("12,34", None),
        ("x936", None),
        ("936abc", None),
        ("", None),
        ("garbage", None),
        ("<|im_end|>936", None),
        ("9" * 5000, "9" * 5000),  # past int()'s digit limit: canonicalised as text
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct():
    record = next(r for r in make_dataset(50, seed=0) if len(r["answer"]) >= 3)
    answer = record["answer"]
    assert is_correct(answer, record)
    assert is_correct(f" The answer is {answer}.<|im_end|>", record)
    assert not is_correct(str(int(answer) + 1), record)
    assert not is_correct(" ".join(answer), record)
    assert not is_correct("", record)
    negative = {**record, "answer": "-12"}
    assert is_correct("-12", negative) and not is_correct("12", negative)
    with pytest.raises(ValueError, match="not an integer"):
        is_correct("1", {**record, "answer": "twelve"})
