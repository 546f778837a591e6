"""The demo task: integer addition and subtraction as one-turn chats, and its verifier.

A problem is "What is 347 + 589?" with the answer "936"; operands have 1 to `max_digits` digits
and a difference may be negative. `extract_answer` and `is_correct` (`posttrain.rewards`'
`extract_integer` and `integer_correct`) are the verifier that scores completions for
evaluation, DPO pair labelling and RL rewards.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping

DOMAIN = "arithmetic"
OPS = ("+", "-")
_QUESTION = "What is {a} {op} {b}?"
_QUESTION_RE = re.compile(r"What is ([0-9]+) ([+-]) ([0-9]+)\?")
Key = tuple[int, str, int]


def make_problem(rng: random.Random, *, max_digits: int = 3) -> dict:
    """Draws one problem.

    Each operand first draws its number of digits uniformly from 1..max_digits (so short
    problems are as common as long ones), then its value; the operation is + or - with equal odds.

    Args:
      rng: the source of randomness.
      max_digits: the most digits an operand has.

    Returns:
      {"messages": [user, assistant], "prompt": [user], "answer": "936", "domain": "arithmetic"}.
    """
    _check_max_digits(max_digits)
    a, b = _operand(rng, max_digits), _operand(rng, max_digits)
    return _record(a, rng.choice(OPS), b)


def make_dataset(
    n: int,
    seed: int,
    *,
    max_digits: int = 3,
    exclude: Iterable[Mapping | Key] = (),
) -> list[dict]:
    """Draws `n` distinct problems, the same ones for the same arguments.

    Args:
      n: the number of problems.
      seed: seeds the draw.
      max_digits: the most digits an operand has.
      exclude: records (or `problem_key` tuples) that must not appear, e.g. the held-out set
        when drawing training problems.

    Returns:
      The records, in draw order.

    Raises:
      ValueError: fewer than `n` distinct problems with `max_digits` are left after `exclude`.
    """
    _check_max_digits(max_digits)
    seen = {k if isinstance(k, tuple) else problem_key(k) for k in exclude}
    free = len(OPS) * 10 ** (2 * max_digits) - sum(_fits(k, max_digits) for k in seen)
    if not 0 <= n <= free:
        raise ValueError(
            f"cannot draw {n} distinct problems: max_digits={max_digits} leaves {free} after "
            f"excluding {len(seen)}; lower n or raise max_digits"
        )
    rng, records = random.Random(seed), []
    while len(records) < n:
        record = make_problem(rng, max_digits=max_digits)
        if (key := problem_key(record)) not in seen:
            seen.add(key)
            records.append(record)
    return records


def problem_key(record: Mapping) -> Key:
    """The (a, op, b) of a record, e.g. (347, "+", 589), read from its question."""
    question = record["prompt"][0]["content"] if "prompt" in record else None
    match = _QUESTION_RE.fullmatch(question) if isinstance(question, str) else None
    if match is None:
        raise ValueError(
            f"not a demo arithmetic record (expected a prompt 'What is A + B?'): {record!r:.200}"
        )
    return int(match[1]), match[2], int(match[3])


def _record(a: int, op: str, b: int) -> dict:
    """The chat record of one problem."""
    question = _QUESTION.format(a=a, op=op, b=b)
    answer = str(a + b if op == "+" else a - b)
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        "prompt": [{"role": "user", "content": question}],
        "answer": answer,
        "domain": DOMAIN,
    }


def _operand(rng: random.Random, max_digits: int) -> int:
    """An integer with a uniformly drawn number of digits (0 counts as one digit)."""
    digits = rng.randint(1, max_digits)
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def _fits(key: Key, max_digits: int) -> bool:
    """Whether a key is a problem `make_problem(max_digits=...)` can draw."""
    a, op, b = key
    return op in OPS and 0 <= a < 10**max_digits and 0 <= b < 10**max_digits


def _check_max_digits(max_digits: int) -> None:
    if not isinstance(max_digits, int) or max_digits < 1:
        raise ValueError(f"max_digits must be a positive integer, got {max_digits!r}")
