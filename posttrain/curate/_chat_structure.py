"""Chat-structure validation: the checks a conversation passes before it is trained on.

`chat_problem(messages)` returns the first problem as (reason, detail), checking in this order:

  bad_role               a role other than system, user, assistant, tool
  system_not_first       a system message after the first message
  bad_tool_call          tool_calls that are not a list of {"function": {"name": str,
                         "arguments": object or JSON-object string}} (the "function" wrapper is
                         optional, as chat templates accept both), or tool_calls on a message
                         that is not the assistant's
  orphan_tool_message    a tool message that no assistant tool call asked for (more tool results
                         than the calls of the assistant turn before them)
  roles_not_alternating  after the optional system message the turns are not user, assistant,
                         user, ...; tool results go between an assistant turn with tool calls and
                         the assistant turn that reads them
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
REASONS = (
    "bad_role",
    "system_not_first",
    "bad_tool_call",
    "orphan_tool_message",
    "roles_not_alternating",
)


def chat_problem(messages: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """The first structure problem of `messages` (dicts with a "role") as (reason, detail), or
    None for a well-formed conversation."""
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            return "bad_role", f"message {i} has role {m['role']!r}; roles are {ROLES}"
    for i, m in enumerate(messages[1:], 1):
        if m["role"] == "system":
            return "system_not_first", f"message {i} is a system message"
    for i, m in enumerate(messages):
        if m.get("tool_calls") is None:
            continue
        if m["role"] != "assistant":
            return "bad_tool_call", f"message {i} ({m['role']}) has tool_calls"
        if not isinstance(m["tool_calls"], list):
            return "bad_tool_call", f"message {i}: tool_calls is not a list"
        for j, call in enumerate(m["tool_calls"]):
            if error := _call_error(call):
                return "bad_tool_call", f"message {i} tool call {j} {error}"
    return _order_problem(messages)


def _order_problem(messages: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    previous, results_left = None, 0  # tool results the last assistant turn's calls allow
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "tool":
            if results_left == 0:
                return "orphan_tool_message", f"message {i}: no tool call asked for it"
            results_left -= 1
        elif role == "user":
            if previous not in (None, "system", "assistant"):
                return "roles_not_alternating", f"message {i}: user after {previous}"
            results_left = 0
        elif role == "assistant":
            if previous not in ("user", "tool"):
                return "roles_not_alternating", f"message {i}: assistant after {previous}"
            results_left = len(m.get("tool_calls") or [])
        previous = role
    return None


def _call_error(call: Any) -> str:
    """Why a tool call is malformed ("" when it is well formed)."""
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return "is not a {'function': {'name', 'arguments'}} object"
    if not isinstance(function.get("name"), str) or not function["name"].strip():
        return "has no function name"
    if "arguments" not in function:
        return "has no arguments"
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "has an arguments string that is not JSON"
    if not isinstance(arguments, Mapping):
        return f"has arguments that are a {type(arguments).__name__}, not an object"
    return ""
