"""Math answers: extraction from a completion and equivalence with the reference answer.

Extraction takes, in priority order: the last `\\boxed{...}` (or `\\fbox`), the last GSM8K
`#### x` line, the last "the answer is x" / "Answer: x", else the last number. Equivalence is
`math_verify` (LaTeX and plain expressions, fractions, roots, sets, intervals, equations,
percentages), with a sympy fallback for plain-text answers it misreads (`pi/2`, `2**10`, `1e3`,
`oo`, `√2`).

Timeouts: math_verify bounds each parse and comparison with SIGALRM, which works only in a
process's main thread (in any other thread it raises). Reward workers run verifiers in their main
thread, so there each step is bounded by `timeout_s`; elsewhere the alarm is switched off and
only the caller's guard (`RewardPool`'s per-call timeout kills the worker) bounds a pathological
expression such as `9^{9^{9^{9}}}`.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import threading
from collections.abc import Mapping

import sympy
from math_verify import parse, verify
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

# "Answer: 5", "the final answer is $5$", "**Answer:** 5".
_ANSWER_IS_RE = re.compile(
    r"(?:\b(?:final\s+)?answer\s+is\s*:?|\banswer\s*:)[\s*]*(?P<tail>[^\n]*)", re.IGNORECASE
)
_GSM8K_RE = re.compile(r"^[ \t]*####[ \t]*(?P<tail>[^\n]*)", re.MULTILINE)
# A number, optionally signed, with thousands separators, decimals or a fraction bar.
_NUMBER_RE = re.compile(
    r"(?<![\w.])[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?%?"
    r"|(?<![\w.])[-+\u2212]?\.\d+"
)
_STRAY_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
# Where an answer stated in prose ends: a period not inside a number ("3.14"), or a word after a
# space ("7 apples", "1/2 because ...") other than a math word.
_PROSE_END_RE = re.compile(r"\.(?!\d)|\s+(?!(?:pi|sqrt|infinity)\b)[a-zA-Z]{3,}")
# Plain-text answers the sympy fallback accepts: digits, operators, brackets, words checked below.
_PLAIN_RE = re.compile(r"[0-9a-zA-Z\s.+\-*/^()=]+")
_PLAIN_WORDS = {"pi", "e", "oo", "inf", "infinity", "sqrt"}
_UNICODE = {
    "\u2212": "-",
    "\u00d7": "*",
    "\u00f7": "/",
    "\u03c0": "pi",
    "\u221e": "oo",
    "\u221a": "sqrt ",
}


def extract_answer(text: str) -> tuple[str, str] | None:
    """Reads the final answer of a completion.

    Args:
      text: the completion.

    Returns:
      (answer, source) with source "boxed", "gsm8k", "answer_is" or "last_number"; None if the
      completion holds no candidate at all.
    """
    if (boxed := _last_boxed(text)) is not None:
        return boxed, "boxed"
    if lines := _GSM8K_RE.findall(text):
        return _clean(_PROSE_END_RE.split(lines[-1], maxsplit=1)[0]), "gsm8k"
    if tails := _ANSWER_IS_RE.findall(text):
        tail = tails[-1].strip()
        if tail.startswith("$"):  # "$...$" holds the whole answer; cut nothing inside it
            fence = "$$" if tail.startswith("$$") else "$"
            end = tail.find(fence, len(fence))
            tail = tail[: end + len(fence)] if end > 0 else tail
        else:
            tail = _PROSE_END_RE.split(tail, maxsplit=1)[0]
        return _clean(tail), "answer_is"
    if numbers := _NUMBER_RE.findall(text):
        return _clean(numbers[-1]), "last_number"
    return None


def math_equal(gold: str, pred: str, *, timeout_s: float = 5.0) -> bool:
    """Whether two answers are mathematically equivalent (see `math_reward`)."""
    return _equivalent(str(gold), pred, timeout_s)[0]


def math_reward(record: Mapping, completion: str, *, timeout_s: float = 5.0) -> tuple[float, dict]:
    """1.0 if the completion's final answer equals `record["answer"]`, else 0.0.

    Args:
      record: holds "answer", the reference (LaTeX or plain text, e.g. "\\frac{1}{2}", "[0,1)").
      completion: the generated text.
      timeout_s: bounds each parse and comparison (rounded up to whole seconds; main thread only,
        see the module docstring).

    Returns:
      (score, info): info holds "extracted" (the answer read, or None), "source" (where it was
      found), "verifier" ("math_verify" or "sympy") on success, and "reason" on failure.
    """
    if "answer" not in record:
        raise ValueError(f"math record has no 'answer' field: {record!r:.200}")
    found = extract_answer(completion)
    if found is None:
        return 0.0, {"extracted": None, "reason": "no answer found"}
    answer, source = found
    info = {"extracted": answer, "source": source}
    if not answer:
        return 0.0, {**info, "reason": "empty answer"}
    equal, how = _equivalent(str(record["answer"]), answer, timeout_s)
    return (1.0, {**info, "verifier": how}) if equal else (0.0, {**info, "reason": how})


def _last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (balanced braces) or `\\boxed x`."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = match.end()
        if text.startswith("{", start):
            depth = 0
            for i in range(start, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
        elif bare := re.match(r"[^\s$]+", text[start:]):  # "\boxed 5"
            return bare[0]
    return None


def _clean(answer: str) -> str:
    """Strips math delimiters, markdown emphasis and trailing punctuation off an answer."""
    answer = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) > len(left):
            answer = answer[len(left) : -len(right)].strip()
    return answer.rstrip(" .,;:").strip("$ ")


def _equivalent(gold: str, pred: str, timeout_s: float) -> tuple[bool, str]:
    """(equal, the verifier that agreed or why not): math_verify, then sympy for plain text."""
    # SIGALRM-based timeouts raise outside the main thread: switch them off there.
    seconds = max(1, math.ceil(timeout_s)) if _main_thread() else None
    gold_parsed = parse(_as_latex(gold), parsing_timeout=seconds)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=seconds)
    if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=seconds):
        return True, "math_verify"
    with _deadline(timeout_s):
        if _sympy_equal(gold, pred, gold_parsed, pred_parsed):
            return True, "sympy"
    if _first_expr(gold_parsed) is None:  # a data error: every completion would score 0
        return False, "reference answer does not parse"
    return False, "wrong answer"


def _as_latex(answer: str) -> str:
    """An answer as math_verify reads LaTeX: inside `$...$` (dropping stray unescaped `$`)."""
    return "$" + _STRAY_DOLLAR_RE.sub("", answer) + "$"


def _sympy_equal(gold: str, pred: str, gold_parsed: list, pred_parsed: list) -> bool:
    """Compares with sympy, reading at least one side as plain text (`pi/2`, `2**10`)."""
    g_plain, p_plain = _plain_sympy(gold), _plain_sympy(pred)
    if g_plain is None and p_plain is None:
        return False
    g = g_plain if g_plain is not None else _first_expr(gold_parsed)
    p = p_plain if p_plain is not None else _first_expr(pred_parsed)
    if g is None or p is None:
        return False
    try:
        if g == p:
            return True
        if not g.free_symbols and not p.free_symbols:
            gv, pv = complex(sympy.N(g)), complex(sympy.N(p))
            return abs(gv - pv) <= 1e-6 * max(1.0, abs(gv))
        return sympy.simplify(g - p) == 0
    except (TypeError, ValueError, ArithmeticError, AttributeError, RecursionError):
        return False


def _plain_sympy(answer: str):
    """A sympy expression from a plain-text answer, or None if it is not plain text."""
    for k, v in _UNICODE.items():
        answer = answer.replace(k, v)
    answer = answer.strip()
    if "=" in answer:  # "x = 2": the value
        left, _, answer = answer.rpartition("=")
        if not re.fullmatch(r"\s*[a-zA-Z]\s*", left):
            return None
    # parse_expr evaluates Python: admit only digits, operators and known words, and dots only
    # as decimal points, so no attribute access or builtin can get through.
    if not answer or not _PLAIN_RE.fullmatch(answer) or re.search(r"\.(?!\d)|[a-zA-Z]\.", answer):
        return None
    words = set(re.findall(r"[a-zA-Z]{2,}", re.sub(r"\d+e\d+", "", answer)))
    if words - _PLAIN_WORDS:
        return None
    names = {"pi": sympy.pi, "e": sympy.E, "oo": sympy.oo, "inf": sympy.oo, "sqrt": sympy.sqrt}
    names["infinity"] = sympy.oo
    transformations = (*standard_transformations, convert_xor, implicit_multiplication_application)
    try:
        return parse_expr(answer, local_dict=names, transformations=transformations)
    except Exception:  # malformed input fails in many ways (SyntaxError, TokenError, ...)
        return None


def _first_expr(parsed: list):
    return next((p for p in parsed if isinstance(p, sympy.Basic)), None)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Timeout(BaseException):
    """Raised by the alarm; a BaseException so sympy's broad `except Exception` cannot eat it."""


@contextlib.contextmanager
def _deadline(seconds: float):
    """Bounds the block with SIGALRM in the main thread (a no-op elsewhere); a timeout is False."""
    if not _main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Timeout:
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
