"""Chat templates rendered the way transformers renders them, in jinja's sandbox.

Templates are untrusted code from model repositories: they run in an immutable sandbox with
HF's globals (`raise_exception`, `strftime_now`, a restricted `namespace` and `dict`), and a
`{% generation %}` extension records which characters belong to assistant turns.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
Spans = list[tuple[int, int]]

# (chunks rendered so far, spans) while a render records {% generation %} blocks, else None.
generation_spans: contextvars.ContextVar[tuple[list[str], Spans] | None] = contextvars.ContextVar(
    "posttrain_generationgeneration_spans", default=None
)


class _GenerationTracker(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` and records the character span it renders."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller):
        text = caller()
        if (state := generation_spans.get()) is not None:
            chunks, spans = state
            # The span starts after what the render loop has consumed so far: transformers'
            # rule, kept even where jinja's output buffering makes it subtle, so masks agree.
            start = sum(map(len, chunks))
            spans.append((start, start + len(text)))
        return text


def _template_dict(*args, **kwargs):
    return dict(*args, **kwargs)


# Templates get this stand-in for `dict`, without the type's attributes (as in HF).
_template_dict.fromkeys = dict.fromkeys


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore names, so templates cannot reach internals (as in HF)."""

    def __init__(*args, **kwargs):  # jinja's signature, so that namespace(self=...) still works
        _check_names(dict(*args[1:], **kwargs))
        jinja2.utils.Namespace.__init__(*args, **kwargs)

    def __setitem__(self, name, value):
        _check_names([name])
        super().__setitem__(name, value)


def _check_names(names):
    if bad := [n for n in names if isinstance(n, str) and n.startswith("_")]:
        raise jinja2.exceptions.SecurityError(f"namespace attributes {bad} are not allowed")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """Compiles a chat template in the sandbox transformers uses (templates are untrusted code)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTracker, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        dict=_template_dict,
        namespace=_Namespace,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template line {e.lineno} has a syntax error: {e.message}") from e


def check_messages(messages: Any) -> list[dict]:
    """Validates messages and normalises them as transformers does before rendering."""
    if isinstance(messages, str | Mapping) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} "
            f"dicts, got {messages!r:.100}"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content' keys, got {m!r:.100}"
            )
        # Templates test `is defined`, so None values (e.g. OpenAI's content=None beside tool_calls)
        # become missing keys; reasoning under older names is aliased to the standard one.
        m = {k: v for k, v in m.items() if v is not None}
        if (reasoning := next((m[k] for k in REASONING_FIELDS if k in m), None)) is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out
