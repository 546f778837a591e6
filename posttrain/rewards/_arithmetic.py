"""Integer answers: the verifier of the demo's arithmetic task (`posttrain.demo`), and any
task whose answer is one integer ("What is 347 + 589?" -> "936")."""

from __future__ import annotations

import re
from collections.abc import Mapping

# Text after the first of these was generated past the end of the turn: it is not the answer.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")
# An integer standing on its own: not glued to a word or another number, optionally with
# thousands separators ("1,998") or a zero fraction ("936.0", rejected later if nonzero).
_NUMBER_RE = re.compile(
    r"(?<![\w.,])(?P<sign>[-+\u2212]?)(?P<int>[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
    r"(?:\.(?P<frac>[0-9]+))?(?!\w|[.,][0-9])"
)
# A number just after another one with only spaces between ("93 6") is a split answer.
_SPLIT_RE = re.compile(r"[0-9][^\S\n]+$")


def extract_integer(text: str) -> str | None:
    """Reads the integer a completion answers with.

    The answer is the last integer before any end-of-turn token; surrounding words, whitespace,
    a sign, thousands separators and a zero fraction are tolerated ("The answer is -1,234.0").

    Args:
      text: the completion.

    Returns:
      The integer in canonical form ("-12", "936"), or None if there is none, the last number is
      not an integer ("93.5") or it looks split ("93 6").
    """
    for end in _END_TOKENS:
        text = text.split(end, 1)[0]
    numbers = list(_NUMBER_RE.finditer(text))
    last = numbers[-1] if numbers else None
    if last is None or (last["frac"] or "0").strip("0") or _SPLIT_RE.search(text, 0, last.start()):
        return None
    digits = last["int"].replace(",", "").lstrip("0") or "0"
    return "-" + digits if last["sign"] in ("-", "\u2212") and digits != "0" else digits


def integer_correct(completion_text: str, record: Mapping) -> bool:
    """Whether a completion's answer (see `extract_integer`) equals the record's, as integers."""
    expected = extract_integer(str(record["answer"]))
    if expected is None:
        raise ValueError(f"record answer {record['answer']!r} is not an integer")
    return extract_integer(completion_text) == expected


def arithmetic_reward(record: Mapping, completion: str) -> tuple[float, dict]:
    """The demo arithmetic task's verifier (`integer_correct`) as a reward."""
    correct = integer_correct(completion, record)
    info = {"extracted": extract_integer(completion)}
    if not correct:
        info["reason"] = "no integer answer" if info["extracted"] is None else "wrong answer"
    return float(correct), info
