"""Grounded long-document QA: the answer must match, and the spans it cites must exist in the
source document.

Completion format: the evidence quoted in `<cite>...</cite>` tags (any number, anywhere), and
the answer on a line `Answer: ...` (the last such line; without one, the whole completion with
its citations removed is the answer):

    The report says <cite>revenue grew 12% in 2023</cite>.
    Answer: 12%

Reward = answer_F1 x ((1 - citation_weight) + citation_weight x citation_score), where
answer_F1 is the SQuAD token F1 (lower case, no punctuation or articles) against the best of
the record's answers, and citation_score the share of cited spans found verbatim in the
document (whitespace-normalised, case kept); no citation scores 0. So a wrong answer earns
nothing whatever it cites, and a right one loses `citation_weight` of its reward for citing
nothing or only invented text.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping

_CITE = re.compile(r"<cite>(.*?)</cite>", re.DOTALL | re.IGNORECASE)
_ANSWER = re.compile(r"^\s*answer\s*:(.*)$", re.IGNORECASE | re.MULTILINE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def grounded_qa_reward(
    record: Mapping, completion: str, *, citation_weight: float = 0.5
) -> tuple[float, dict]:
    """Answer F1 scaled by citation validity (see the module docstring for the formula).

    Args:
      record: with "document" (the source text) and "answer" (a string) or "answers" (a list
        of acceptable strings).
      completion: the generated text.
      citation_weight: the share of the reward that rests on valid citations, in [0, 1]
        (register a `functools.partial` of this function to change it).

    Returns:
      (score, info): info holds "answer" (as extracted), "exact_match", "answer_f1",
      "citations" (how many), "valid_citations", "citation_score" and "invented" (the first
      three cited spans not in the document).

    Raises:
      ValueError: the record lacks a document or answers, or citation_weight is outside [0, 1].
    """
    if not 0 <= citation_weight <= 1:
        raise ValueError(f"citation_weight must lie in [0, 1], got {citation_weight}")
    document = record.get("document") if isinstance(record, Mapping) else None
    answers = record.get("answers", [record.get("answer")]) if isinstance(record, Mapping) else []
    if not isinstance(document, str) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(
            "a grounded_qa record needs a 'document' string and an 'answer' string (or "
            f"'answers', a list of strings): {record!r:.200}"
        )
    cited = _CITE.findall(completion)
    lines = _ANSWER.findall(completion)
    answer = _CITE.sub(" ", lines[-1] if lines else completion).strip()
    source = _squash(document)
    invented = [c for c in cited if not (_squash(c) and _squash(c) in source)]
    citation_score = (len(cited) - len(invented)) / len(cited) if cited else 0.0
    f1 = max(token_f1(answer, a) for a in answers)
    score = f1 * ((1 - citation_weight) + citation_weight * citation_score)
    return score, {
        "answer": answer,
        "exact_match": any(normalize_answer(answer) == normalize_answer(a) for a in answers),
        "answer_f1": f1,
        "citations": len(cited),
        "valid_citations": len(cited) - len(invented),
        "citation_score": citation_score,
        "invented": [c[:200] for c in invented[:3]],
    }


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(predicted: str, gold: str) -> float:
    """SQuAD's token F1 of two answers after `normalize_answer` (1 when both are empty)."""
    pred, true = normalize_answer(predicted).split(), normalize_answer(gold).split()
    if not pred or not true:
        return float(pred == true)
    common = sum((collections.Counter(pred) & collections.Counter(true)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(true)
    return 2 * precision * recall / (precision + recall)


def _squash(text: str) -> str:
    """Runs of whitespace made one space, ends stripped."""
    return " ".join(text.split())
