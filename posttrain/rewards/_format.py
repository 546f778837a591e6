"""Structure rewards: tag layout, JSON tool calls checked against a schema, over-length penalty.

Each check names the first thing that failed in `info["reason"]`, so a run's logs say why
completions score 0 ("<answer> appears 2 times", "argument 'city' is a required property").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import numpy as np

DEFAULT_TAGS = ("think", "answer")


def check_format(text: str, tags: Sequence[str] = DEFAULT_TAGS) -> str | None:
    """Checks that `text` is exactly `<t1>...</t1><t2>...</t2>...` for the given tags.

    Each tag must open and close exactly once, in the given order, with non-empty content and
    nothing but whitespace outside the tags.

    Args:
      text: the completion.
      tags: the tag names in their required order.

    Returns:
      None if the layout is right, else the first failure, e.g. "<answer> appears 2 times".
    """
    spans = []
    for tag in tags:
        for mark in (f"<{tag}>", f"</{tag}>"):
            n = text.count(mark)
            if n != 1:
                return f"missing {mark}" if n == 0 else f"{mark} appears {n} times (expected once)"
        start, end = text.index(f"<{tag}>"), text.index(f"</{tag}>")
        if end < start:
            return f"</{tag}> comes before <{tag}>"
        if not text[start + len(tag) + 2 : end].strip():
            return f"<{tag}> is empty"
        spans.append((start, end + len(tag) + 3, tag))
    for (_, end, tag), (start, _, following) in zip(spans, spans[1:], strict=False):
        if start < end:
            return f"<{following}> must come after </{tag}>"
    cursor = 0
    for start, end, _ in spans:
        if outside := text[cursor:start].strip():
            return f"text outside the tags: {outside[:40]!r}"
        cursor = end
    if outside := text[cursor:].strip():
        return f"text outside the tags: {outside[:40]!r}"
    return None


def format_reward(
    record: Mapping, completion: str, *, tags: Sequence[str] = DEFAULT_TAGS
) -> tuple[float, dict]:
    """1.0 if the completion follows the tag layout (see `check_format`), else 0.0.

    Args:
      record: may override the tags with a "format_tags" list.
      completion: the generated text.
      tags: the tag names in order, when the record does not set them.

    Returns:
      (score, info) with info["reason"] naming the failure.
    """
    reason = check_format(completion, record.get("format_tags", tags))
    return (1.0, {}) if reason is None else (0.0, {"reason": reason})


def schema_violation(schema: Mapping, value: object, owner: str, root: str) -> str | None:
    """The most relevant error of `value` against a JSON schema, as "schema violation at
    <path>: <message>"; None if it validates. `root` names the path of `value` itself.

    Raises:
      ValueError: `schema` is not a valid JSON schema (named by `owner`): a data error.
    """
    import jsonschema

    validator_cls = jsonschema.validators.validator_for(schema)
    try:
        validator_cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"{owner} has an invalid JSON schema: {e.message}") from e
    if error := jsonschema.exceptions.best_match(validator_cls(schema).iter_errors(value)):
        where = "/".join(map(str, error.absolute_path)) or root
        return f"schema violation at {where}: {error.message}"
    return None


def tool_call_reward(
    record: Mapping, completion: str, *, tag: str = "tool_call"
) -> tuple[float, dict]:
    """1.0 if the completion makes one valid call to one of the record's tools, else 0.0.

    The completion must hold exactly one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (text around it is allowed) whose name is one of `record["tools"]` and whose arguments
    validate against that tool's JSON schema. If the record holds "expected_call" (a dict with
    "name" and "arguments"), the call must also equal it.

    Args:
      record: holds "tools": [{"name": ..., "parameters": <JSON schema>}] (OpenAI's
        {"type": "function", "function": {...}} form is accepted too).
      completion: the generated text.
      tag: the tag around the call.

    Returns:
      (score, info): info holds "call" (the parsed call) once it parses, and "reason" naming the
      failed check (no call, invalid JSON, unknown tool, schema violation, wrong call).

    Raises:
      ValueError: the record has no tools, or a tool's schema is not a valid JSON schema (a data
        error: it would fail every completion).
    """
    tools = _tools_by_name(record)
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", completion, re.DOTALL)
    if len(blocks) != 1:
        n = len(blocks)
        return 0.0, {
            "reason": f"no <{tag}> block" if n == 0 else f"{n} <{tag}> blocks (expected 1)"
        }
    try:
        call = json.loads(blocks[0])
    except json.JSONDecodeError as e:
        return 0.0, {"reason": f"invalid JSON: {e}"}
    if not isinstance(call, dict):
        return 0.0, {"reason": f"the call is a JSON {type(call).__name__}, not an object"}
    info = {"call": call}
    name, args = call.get("name"), call.get("arguments", {})
    if isinstance(args, str):  # OpenAI-style arguments serialized as a string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return 0.0, {**info, "reason": f"'arguments' string is invalid JSON: {e}"}
    if not isinstance(name, str):
        return 0.0, {**info, "reason": "missing 'name' (a string)"}
    if not isinstance(args, dict):
        return 0.0, {**info, "reason": f"'arguments' is a {type(args).__name__}, not an object"}
    if name not in tools:
        return 0.0, {**info, "reason": f"unknown tool {name!r} (available: {', '.join(tools)})"}
    if violation := schema_violation(tools[name], args, f"tool {name!r}", "arguments"):
        return 0.0, {**info, "reason": violation}
    if expected := record.get("expected_call"):
        if name != expected["name"]:
            return 0.0, {**info, "reason": f"wrong tool: expected {expected['name']!r}"}
        if args != expected.get("arguments", {}):
            return 0.0, {**info, "reason": "arguments differ from the expected call"}
    return 1.0, info


def _tools_by_name(record: Mapping) -> dict[str, dict]:
    tools = record.get("tools")
    if not tools:
        raise ValueError(f"tool-call record has no 'tools' list: {record!r:.200}")
    out = {}
    for tool in tools:
        tool = tool.get("function", tool)  # OpenAI {"type": "function", "function": {...}}
        out[tool["name"]] = tool.get("parameters", {"type": "object"})
    return out


def overlong_penalty(num_tokens, max_len: int, buffer: int):
    """DAPO's soft over-length penalty, added to the reward.

    0 up to `max_len - buffer` tokens, then linear down to -1 at `max_len`, and -1 beyond.

    Args:
      num_tokens: completion lengths in tokens (an int or an array).
      max_len: the length that earns the full penalty.
      buffer: the width of the linear ramp, 0 < buffer <= max_len.

    Returns:
      A float for an int, else an array of the same shape.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer <= max_len, got {buffer}, {max_len}")
    penalty = np.clip((max_len - buffer - np.asarray(num_tokens, np.float64)) / buffer, -1.0, 0.0)
    return float(penalty) if penalty.ndim == 0 else penalty
