"""Professional-document rewards: structured extraction (schema validity, field F1) and grounded
QA (answer F1, cited spans), against hand-computed values."""

import functools
import json

import pytest

from posttrain.rewards import (
    RewardPool,
    default_registry,
    extraction_reward,
    field_f1,
    grounded_qa_reward,
    token_f1,
)
from posttrain.rewards._extraction import flatten

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "amount": {"type": "number"},
        "items": {"type": "array", "items": {"type": "string"}},
        "paid": {"type": "boolean"},
    },
    "required": ["name", "amount"],
}
GOLD = {"name": "ACME Corp", "amount": 1200.5, "items": ["bolts", "nuts"], "paid": False}
RECORD = {"domain": "extraction", "schema": SCHEMA, "gold": GOLD}


def test_flatten_normalises_leaves():
    assert flatten({"a": {"b": [1, " X  y "]}, "c": True, "d": None, "e": {}, "f": "2.50"}) == [
        ("a.b[0]", 1.0),
        ("a.b[1]", "x y"),
        ("c", ("literal", True)),
        ("d", ("literal", None)),
        ("e", ("empty", "dict")),
        ("f", 2.5),
    ]
    assert flatten(True) != flatten(1) and flatten("true") != flatten(True)


def test_field_f1_by_hand():
    # Gold pairs: name, amount, items[0], items[1], paid (5). Predicted: name (case and spaces
    # differ: a hit), amount as a string (a hit), items[0] (hit), items[1] "washers" (miss),
    # no paid, an extra "notes" (miss): 3 hits of 5 predicted and 5 gold.
    predicted = {"name": " acme  corp", "amount": "1200.50", "items": ["Bolts", "washers"],
                 "notes": "x"}  # fmt: skip
    precision, recall, f1 = field_f1(predicted, GOLD)
    assert (precision, recall) == (3 / 5, 3 / 5) and f1 == pytest.approx(0.6, abs=1e-15)
    assert field_f1({"name": "ACME Corp"}, GOLD) == (1.0, 1 / 5, pytest.approx(2 * 0.2 / 1.2))
    assert field_f1({}, {}) == (1.0, 1.0, 1.0)
    assert field_f1({"x": 1}, GOLD) == (0.0, 0.0, 0.0)


def test_extraction_reward_valid_fenced_and_broken():
    exact = json.dumps(GOLD)
    assert extraction_reward(RECORD, exact) == (
        1.0,
        {"valid_json": True, "valid_schema": True, "precision": 1.0, "recall": 1.0, "f1": 1.0},
    )
    fenced = f"Here is the record:\n```json\n{json.dumps({'name': 'acme corp', 'amount': 1})}\n```"
    score, info = extraction_reward(RECORD, fenced)
    # 1 hit (name) of 2 predicted and 5 gold: P 1/2, R 1/5, F1 = 2 * 0.1 / 0.7 = 2/7.
    assert info["valid_schema"] and (info["precision"], info["recall"]) == (0.5, 0.2)
    assert score == pytest.approx(2 / 7, abs=1e-15)
    score, info = extraction_reward(RECORD, '{"name": "ACME Corp", "amount": 12')
    assert score == 0.0 and not info["valid_json"] and info["reason"].startswith("invalid JSON")
    score, info = extraction_reward(RECORD, "```json\nnot json\n```")
    assert score == 0.0 and not info["valid_json"]


def test_schema_invalid_scores_its_configured_share():
    # "amount" must be a number: schema-invalid, though 4 of 5 fields match (P 4/5, R 4/5).
    wrong_type = json.dumps({**GOLD, "amount": "1200.5"})
    score, info = extraction_reward(RECORD, wrong_type)
    assert score == 0.0 and info["valid_json"] and not info["valid_schema"]
    assert info["f1"] == 1.0  # "1200.5" normalises like 1200.5: the fields all match
    assert info["reason"] == "schema violation at amount: '1200.5' is not of type 'number'"
    missing = json.dumps({"name": "ACME Corp"})
    partial = functools.partial(extraction_reward, schema_invalid_weight=0.5)
    score, info = partial(RECORD, missing)
    assert "'amount' is a required property" in info["reason"]
    assert score == pytest.approx(0.5 * (2 * 0.2 / 1.2), abs=1e-15)
    with pytest.raises(ValueError, match="invalid JSON schema"):
        extraction_reward({**RECORD, "schema": {"type": 3}}, "{}")
    with pytest.raises(ValueError, match="needs a 'gold'"):
        extraction_reward({"schema": SCHEMA}, "{}")
    as_string = {**RECORD, "schema": json.dumps(SCHEMA)}
    assert extraction_reward(as_string, json.dumps(GOLD))[0] == 1.0


DOCUMENT = """Quarterly report.
Revenue grew 12% in 2023, driven by
exports to   Canada. The board approved a dividend of $2 per share."""


def _qa(completion, **kwargs):
    record = {"domain": "grounded_qa", "document": DOCUMENT, "answer": "12%"}
    return grounded_qa_reward(record, completion, **kwargs)


def test_token_f1_by_hand():
    assert token_f1("The $2, per share.", "2 per share") == 1.0  # articles, punctuation
    # pred {dividend, 2, per, share}, gold {2, per, share}: P 3/4, R 1, F1 6/7.
    assert token_f1("The dividend: $2 per share", "2 per share") == pytest.approx(6 / 7, abs=1e-15)
    # pred {dividend, of, 2}, gold {2, per, share}: 1 common, P 1/3, R 1/3.
    assert token_f1("a dividend of 2", "2 per share") == pytest.approx(1 / 3, abs=1e-15)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0


def test_real_citation_and_answer_score_one():
    # The cited span crosses a line break and a run of spaces in the document.
    score, info = _qa(
        "The report says <cite>grew 12% in 2023, driven by exports to Canada.</cite>\nAnswer: 12%"
    )
    assert score == 1.0
    assert info["answer"] == "12%" and info["exact_match"] and info["citation_score"] == 1.0


def test_invented_or_missing_citations_cost():
    # Right answer, one real and one invented span: citation score 1/2, reward 0.5 + 0.5 * 0.5.
    score, info = _qa(
        "<cite>Revenue grew 12% in 2023</cite> and <cite>profit doubled</cite>\nAnswer: 12%"
    )
    assert score == 0.75 and info["invented"] == ["profit doubled"]
    assert (info["citations"], info["valid_citations"]) == (2, 1)
    assert _qa("Answer: 12%")[0] == 0.5  # no citation: half the reward
    assert _qa("<cite>revenue grew 12%</cite>\nAnswer: 12%")[0] == 0.5  # case kept: invented
    # "Answer:" must start a line: here the answer is the whole text, {answer, 12} vs {12}.
    assert _qa("<cite>Revenue grew 12%</cite> Answer: 12%")[0] == pytest.approx(2 / 3, abs=1e-15)
    assert _qa("<cite>Revenue grew 12%</cite>\nAnswer: 12%", citation_weight=0.2)[0] == 1.0
    assert _qa("Answer: 12%", citation_weight=0.2)[0] == 0.8
    # A wrong answer earns nothing, whatever it cites.
    assert _qa("<cite>Revenue grew 12% in 2023</cite>\nAnswer: Canada")[0] == 0.0
    # Without an "Answer:" line the text minus citations is the answer: {12, in, 2023} vs {12}.
    score, info = _qa("<cite>Revenue grew 12%</cite> 12% in 2023")
    assert info["answer"] == "12% in 2023" and score == pytest.approx(0.5, abs=1e-15)
    multi = {"document": DOCUMENT, "answers": ["Canada", "exports to Canada"]}
    assert grounded_qa_reward(multi, "<cite>exports to Canada</cite>\nAnswer: Canada")[0] == 1.0
    with pytest.raises(ValueError, match="'document' string"):
        grounded_qa_reward({"answer": "x"}, "Answer: x")
    with pytest.raises(ValueError, match="citation_weight"):
        _qa("Answer: 12%", citation_weight=2)


def test_default_registry_scores_both_domains_in_workers():
    records = [RECORD, {"domain": "grounded_qa", "document": DOCUMENT, "answer": "12%"}]
    texts = [json.dumps(GOLD), "<cite>dividend of $2</cite>\nAnswer: 12%"]
    with RewardPool(default_registry(), workers=1) as pool:
        results = pool.score(records, texts)
    assert [(r.status, r.score) for r in results] == [("ok", 1.0), ("ok", 1.0)]
    assert results[0].info["extraction_reward"]["valid_schema"] is True
