"""Structured extraction: the completion is a JSON record, valid against the record's JSON
schema and scored by field-level F1 against its gold record.

Both records are flattened to (leaf path, value) pairs: `{"a": {"b": [1, "X "]}}` is
{("a.b[0]", 1.0), ("a.b[1]", "x")}. Values are lightly normalised (strings stripped, case-folded,
inner whitespace collapsed; numbers, and strings that read as numbers, as floats; booleans and
null kept apart from numbers and strings), so "42", 42 and 42.0 match. Precision is the share
of predicted pairs in the gold set, recall the share of gold pairs predicted, F1 their
harmonic mean.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

from posttrain.rewards._format import schema_violation

_FENCED = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def extraction_reward(
    record: Mapping, completion: str, *, schema_invalid_weight: float = 0.0
) -> tuple[float, dict]:
    """Field-level F1 of the completion's JSON against `record["gold"]`, if schema-valid.

    The JSON is the completion's first ```json (or plain ```) fenced block, else the whole
    completion. Invalid JSON scores 0; JSON that breaks `record["schema"]` scores
    `schema_invalid_weight` x F1 (default 0: nothing); valid JSON scores its F1.

    Args:
      record: with "gold" (the expected JSON value) and "schema" (a JSON schema, as an object
        or a JSON string).
      completion: the generated text.
      schema_invalid_weight: the share of its F1 that schema-invalid JSON keeps (register a
        `functools.partial` of this function to change it).

    Returns:
      (score, info): info holds "valid_json", "valid_schema", "precision", "recall", "f1" and,
      where something failed, "reason".

    Raises:
      ValueError: the record has no gold or schema, or an invalid schema (a data error).
    """
    gold, schema = _field(record, "gold"), _field(record, "schema")
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, Mapping):
        raise ValueError(f"an extraction record's 'schema' must be an object: {record!r:.200}")
    info = {"valid_json": False, "valid_schema": False, "precision": 0.0, "recall": 0.0, "f1": 0.0}
    match = _FENCED.search(completion)
    try:
        predicted = json.loads(match.group(1) if match else completion)
    except json.JSONDecodeError as e:
        return 0.0, {**info, "reason": f"invalid JSON: {e}"}
    precision, recall, f1 = field_f1(predicted, gold)
    info.update(valid_json=True, precision=precision, recall=recall, f1=f1)
    if violation := schema_violation(schema, predicted, "the extraction record", "the record"):
        return schema_invalid_weight * f1, {**info, "reason": violation}
    return f1, {**info, "valid_schema": True}


def field_f1(predicted: object, gold: object) -> tuple[float, float, float]:
    """(precision, recall, F1) of the predicted (path, value) pairs against the gold ones;
    (1, 1, 1) when both are empty."""
    pred, true = set(flatten(predicted)), set(flatten(gold))
    if not pred and not true:
        return 1.0, 1.0, 1.0
    hits = len(pred & true)
    if not hits:
        return 0.0, 0.0, 0.0
    precision, recall = hits / len(pred), hits / len(true)
    return precision, recall, 2 * precision * recall / (precision + recall)


def flatten(value: object, path: str = "") -> list[tuple[str, object]]:
    """(leaf path, normalised value) pairs: "a.b[0]"-style paths; an empty object or array is
    a leaf of its own."""
    if isinstance(value, Mapping) and value:
        return [
            pair for k, v in value.items() for pair in flatten(v, f"{path}.{k}" if path else str(k))
        ]
    if isinstance(value, list) and value:
        return [pair for i, v in enumerate(value) for pair in flatten(v, f"{path}[{i}]")]
    return [(path, normalize_value(value))]


def normalize_value(value: object) -> object:
    """A leaf value made comparable: see the module docstring."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else str(value)
    if isinstance(value, str):
        text = " ".join(value.split()).casefold()
        return float(text) if _NUMBER.fullmatch(text) else text
    return ("empty", type(value).__name__)  # {} or []


def _field(record: Mapping, key: str):
    if not isinstance(record, Mapping) or key not in record:
        raise ValueError(f"an extraction record needs a '{key}' field: {record!r:.200}")
    return record[key]
