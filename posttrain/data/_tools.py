"""Tools for agentic RL: JSON schemas from Python functions, tool calls parsed from model output.

`tool_schema(fn)` gives the schema `transformers.utils.get_json_schema(fn)` gives (key order
included, since chat templates `tojson` it), from type hints and a Google-style docstring.

Models write tool calls in their own format; `parse_tool_calls(text, format)` reads them back
into OpenAI tool calls with the parser registered under that format's name:

  "hermes"       Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
                 blocks anywhere in the text.
  "llama3_json"  Llama 3.1 JSON tool calling: the message is `{"name": ..., "parameters": {...}}`,
                 optionally after `<|python_tag|>`; several calls separated by `;`.
  "mistral"      Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; ids are 9
                 alphanumeric characters, the only ids Mistral's template accepts.

Each call is `{"id", "type": "function", "function": {"name", "arguments": dict}}`, what chat
templates render an assistant message's `tool_calls` from. Parsing never raises: a malformed
call is left out of the calls, described in `errors`, and its text stays in `content`.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import secrets
import string
import types
import typing
import uuid
from collections.abc import Callable
from typing import Any

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_BARE = {**_SCALARS, list: "array", tuple: "array", dict: "object"}

# The docstring grammar of transformers' get_json_schema, so that descriptions split the same
# way: an argument is "name:" or "name (type):", and lines indented deeper continue it.
_DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG = re.compile(
    r"(?:^|\n)([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*(.*?)\s*"
    r"(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)",
    re.DOTALL,
)
_RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


class _NoSchema(ValueError):
    """A type hint that has no JSON schema."""


def _enum(values: list, where: str) -> dict:
    """An "enum" schema; its "type" lists each value's JSON type once, in order of appearance."""
    if not values or any(type(v) not in _SCALARS for v in values):
        raise _NoSchema(f"{where}: enum values must be int, float, str, bool or None, got {values}")
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _type_schema(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint (`where` names the parameter in errors)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum([member.value for member in hint], f"{where} ({hint.__name__})")
        if hint is Any:
            return {}
        if hint not in _BARE:
            raise _NoSchema(
                f"{where}: the type hint {hint!r} has no JSON schema; use int, float, str, bool, "
                "an Enum, Literal, or list/tuple/dict/Union of those"
            )
        return {"type": _BARE[hint]}
    if origin is typing.Union or origin is types.UnionType:
        subtypes = [_type_schema(t, where) for t in args if t is not type(None)]
        if len(subtypes) == 1:
            out = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subtypes}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is typing.Literal and args:
        return _enum(list(args), where)
    if origin is list:
        return (
            {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
        )
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise _NoSchema(
                f"{where}: tuple hints must list each element's type, as tuple[int, str] "
                f"(got {hint}); use list[X] for sequences of any length"
            )
        return {"type": "array", "prefixItems": [_type_schema(t, where) for t in args]}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _type_schema(args[1], where)
        return out
    raise _NoSchema(f"{where}: the type hint {hint} has no JSON schema")


def _parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """(description, {argument: description}, returns) of a Google-style docstring."""
    description = m.group(1).strip() if (m := _DESCRIPTION.search(doc)) else None
    returns = m.group(1).strip() if (m := _RETURNS.search(doc)) else None
    args = {}
    if m := _ARGS.search(doc):
        block = "\n".join(line for line in m.group(1).split("\n") if line.strip())
        args = {
            name: re.sub(r"\s*\n+\s*", " ", text.strip()) for _, name, text in _ARG.findall(block)
        }
    return description, args, returns


def tool_schema(fn: Callable) -> dict:
    """The OpenAI / Hugging Face tool schema of a function, as transformers' `get_json_schema`.

    Args:
      fn: a function (or method: an unannotated `self`/`cls` is skipped) with a type hint on
        every parameter and a Google-style docstring that describes each one under `Args:`.
        A description ending in `(choices: [...])` (a JSON list) becomes the parameter's
        `enum`; a return annotation becomes the function's `return` schema, described by the
        docstring's `Returns:` section (left out if it has no JSON schema).

    Returns:
      `{"type": "function", "function": {"name", "description", "parameters": {"type":
      "object", "properties", "required"}, "return"?}}`; "required" lists the parameters
      without defaults and is left out when there are none.

    Raises:
      ValueError: `fn` has no docstring, a parameter without a type hint or a description, or
        a type hint that has no JSON schema.
    """
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name!r} has no docstring; describe it and its Args: there")
    description, arg_docs, returns_doc = _parse_docstring(doc.strip())
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    first = next(iter(params), None)
    receiver = first in ("self", "cls") and params[first].annotation is inspect.Parameter.empty
    skip = first if receiver else None
    required = []
    for param in params.values():
        if param.name == skip:
            continue
        if param.annotation is inspect.Parameter.empty:
            raise ValueError(f"tool {name!r}: parameter {param.name!r} has no type hint; add one")
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    properties = {}
    for arg, hint in hints.items():  # in annotation order, "return" last, as transformers
        if arg == skip:
            continue
        try:
            properties[arg] = _type_schema(hint, f"tool {name!r}, parameter {arg!r}")
        except _NoSchema:
            if arg != "return":  # the model never writes the return value: not worth failing
                raise
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    returns = properties.pop("return", None)
    if returns is not None and returns_doc is not None:
        returns["description"] = returns_doc
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise ValueError(
                f"tool {name!r}: parameter {arg!r} has no description; add "
                f"'{arg}: ...' under Args: in its docstring"
            )
        text = arg_docs[arg]
        if choices := _CHOICES.search(text):
            values = json.loads(choices.group(1))
            schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
            text = text[: choices.start()].strip()
        schema["description"] = text
    function = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        function["return"] = returns
    return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn read back from a model's text.

    Attributes:
      content: the text that is not a parsed tool call, stripped.
      tool_calls: OpenAI tool calls `{"id", "type": "function", "function": {"name",
        "arguments": dict}}`, in the order written.
      errors: one human-readable line per malformed call (left out of `tool_calls`).
    """

    content: str
    tool_calls: list[dict]
    errors: list[str]


ToolParser = Callable[[str], ParsedTurn]
TOOL_FORMATS: dict[str, ToolParser] = {}


def register_tool_format(name: str, parser: ToolParser) -> None:
    """Registers `parser(text) -> ParsedTurn` as tool-call format `name`.

    Raises:
      ValueError: another parser is already registered under `name`.
    """
    if TOOL_FORMATS.get(name, parser) is not parser:
        raise ValueError(f"tool format {name!r} is already registered ({TOOL_FORMATS[name]})")
    TOOL_FORMATS[name] = parser


def parse_tool_calls(text: str, format: str) -> ParsedTurn:
    """Reads the tool calls in a model's output, written in tool-call format `format`.

    Args:
      text: the assistant turn's text, without the end-of-turn token.
      format: a name in `TOOL_FORMATS` ("hermes", "llama3_json", "mistral", ...);
        `tool_format_for(chat_template)` guesses it from a tokenizer's template.

    Returns:
      The turn's content, tool calls, and an error line for each malformed call.

    Raises:
      ValueError: no format of that name is registered.
    """
    if format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {format!r}; registered: {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[format](text)


def tool_format_for(chat_template: str) -> str:
    """The tool-call format a chat template writes, guessed from its text ("hermes" if unsure)."""
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or (
        "<|start_header_id|>" in chat_template and "tools" in chat_template
    ):
        return "llama3_json"
    return "hermes"


def _hex_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ALPHANUMERIC = string.ascii_letters + string.digits


def _mistral_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _json_error(e: json.JSONDecodeError) -> str:
    return f"{e.msg} at char {e.pos}"


def _json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")


def _call(obj: Any, number: int, arguments_key: str, call_id: str) -> dict | str:
    """The OpenAI tool call that decoded JSON `obj` writes, or the error line saying why not."""
    if not isinstance(obj, dict):
        return f"tool call {number} is a JSON {_json_kind(obj)}, not an object"
    if not isinstance(obj.get("name"), str) or not obj["name"]:
        return f'tool call {number} has no "name" string'
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f'tool call {number}\'s "{arguments_key}" string is not JSON: {_json_error(e)}'
    if not isinstance(arguments, dict):
        kind = _json_kind(arguments)
        return f'tool call {number}\'s "{arguments_key}" is a JSON {kind}, not an object'
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(f"{_HERMES_OPEN}(.*?){_HERMES_CLOSE}", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Tool calls in `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    calls, errors, kept, end = [], [], [], 0
    for number, block in enumerate(_HERMES_BLOCK.finditer(text), 1):
        kept.append(text[end : block.start()])
        end = block.end()
        try:
            call = _call(json.loads(block.group(1)), number, "arguments", _hex_id())
        except json.JSONDecodeError as e:
            call = f"tool call {number} is not valid JSON: {_json_error(e)}"
        if isinstance(call, str):
            errors.append(call)
            kept.append(block.group(0))
        else:
            calls.append(call)
    rest = text[end:]
    if _HERMES_OPEN in rest:
        errors.append(f"tool call {len(calls) + len(errors) + 1} has no closing {_HERMES_CLOSE}")
    return ParsedTurn("".join([*kept, rest]).strip(), calls, errors)


_PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*(;\s*)?")
_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str) -> ParsedTurn:
    """Tool calls of Llama 3.1's JSON format: `{"name": ..., "parameters": {...}}`; `;` between."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].lstrip()
    elif not body.startswith("{"):
        return ParsedTurn(text.strip(), [], [])  # plain text
    calls, errors, pos = [], [], 0
    while pos < len(body):
        number = len(calls) + 1
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"tool call {number} is not valid JSON: {_json_error(e)}")
            break
        call = _call(obj, number, "parameters", _hex_id())
        if isinstance(call, str):
            errors.append(call)
            break
        calls.append(call)
        if not (separator := _SEPARATOR.match(body, end)).group(1):
            pos = end
            break  # text after the last call is content
        pos = separator.end()
    return ParsedTurn(body[pos:].strip(), calls, errors)


_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def parse_mistral(text: str) -> ParsedTurn:
    """Tool calls of Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`."""
    head, tag, tail = text.partition(_MISTRAL_TAG)
    if not tag:
        return ParsedTurn(text.strip(), [], [])
    body = tail.lstrip()
    try:
        decoded, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError as e:
        return ParsedTurn(text.strip(), [], [f"tool calls are not valid JSON: {_json_error(e)}"])
    calls, errors = [], []
    for number, obj in enumerate(decoded if isinstance(decoded, list) else [decoded], 1):
        given = obj.get("id") if isinstance(obj, dict) else None
        # A valid id the model wrote is kept: the tool results will answer to it.
        valid = isinstance(given, str) and _MISTRAL_ID.fullmatch(given)
        call = _call(obj, number, "arguments", given if valid else _mistral_id())
        (errors if isinstance(call, str) else calls).append(call)
    if errors:
        return ParsedTurn(text.strip(), calls, errors)
    return ParsedTurn((head + body[end:]).strip(), calls, errors)


register_tool_format("hermes", parse_hermes)
register_tool_format("llama3_json", parse_llama3_json)
register_tool_format("mistral", parse_mistral)
