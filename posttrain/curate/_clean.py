"""`posttrain data clean`: rule-based cleaning of SFT records, every drop counted by reason.

Each record goes through the rules below in this order; the first rule it fails drops it, with
that rule's reason (so a record has exactly one reason). Rules that do not apply to a record's
format are skipped (a `{"text"}` record has no turns or roles).

  reason                  rule
  invalid_json            the record is not a JSON object
  unknown_format          its keys match no format: {"messages"}, {"prompt", "completion"}, {"text"}
  malformed               the format's fields have the wrong types (messages not a list of
                          {"role", "content"} objects, content neither a string nor null, ...)
  empty                   nothing left to train on once text is cleaned and empty turns removed:
                          an empty text, prompt or completion, or a conversation without a user
                          or without an assistant turn
  bad_role, system_not_first, bad_tool_call, orphan_tool_message, roles_not_alternating
                          the chat structure is wrong (with validate_chat; the rules and their
                          order are in posttrain/curate/_chat_structure.py)
  too_few_turns, too_many_turns   user + assistant turns outside [min_turns, max_turns]
  too_short, too_long     characters of all the record's text outside [min_chars, max_chars]
  language                py3langid's language of the user + assistant text is not one of
                          `languages`, or its normalised probability is below
                          `min_language_confidence`
  unencodable             a value the output cannot hold (a lone surrogate with strip_control
                          off, a Parquet value JSON cannot write)

Before the rules that look at the text, the text fields (message content and reasoning,
prompt, completion, text) are normalised to a Unicode form and stripped of control characters
(Unicode category Cc except newline and tab, and lone surrogates), and messages with no text and
no tool calls are removed. A kept record counts under each of `MODIFICATIONS` that changed it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tqdm.auto import tqdm

from posttrain.curate._chat_structure import REASONS as CHAT_REASONS
from posttrain.curate._chat_structure import chat_problem
from posttrain.data import (
    REASONING_FIELDS,
    RecordError,
    Records,
    RecordWriter,
    detect_format,
    kind_of,
)

REASONS = (
    *("invalid_json", "unknown_format", "malformed", "empty"),
    *CHAT_REASONS,
    *("too_few_turns", "too_many_turns", "too_short", "too_long", "language", "unencodable"),
)
MODIFICATIONS = ("normalized", "control_chars_stripped", "empty_turns_removed")
FORMS = ("NFC", "NFKC", "NFD", "NFKD")
LANGUAGE_CHARS = 1000  # py3langid reads this many characters of a record: plenty to be sure

# Category Cc without \t and \n, plus the surrogates (only lone ones can sit in a Python str).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


@dataclasses.dataclass(frozen=True)
class CleanConfig:
    """The rules of one source (module docstring). Defaults clean text and check structure but
    bound nothing and keep every language.

    Attributes:
      normalize: Unicode normalisation form of the text: NFC, NFKC, NFD, NFKD, or None.
      strip_control: remove control characters (Cc except newline and tab; lone surrogates).
      drop_empty_turns: remove messages whose content is empty or whitespace and that carry no
        tool calls (a conversation left without a user or an assistant turn is dropped).
      validate_chat: check roles, their order and tool calls.
      min_chars: fewest characters of all the record's text.
      max_chars: most characters of all the record's text (None: no bound).
      min_turns: fewest user + assistant turns (chat formats only).
      max_turns: most user + assistant turns (None: no bound).
      languages: ISO 639-1 codes py3langid knows ("en", "de", ...); records in other languages
        are dropped. Empty: no language filter.
      min_language_confidence: with `languages`, the smallest normalised probability py3langid
        may give the record's language (0 keeps every record in a listed language).

    Raises:
      ValueError: an option is out of range or a language code is unknown to py3langid.
    """

    normalize: str | None = "NFC"
    strip_control: bool = True
    drop_empty_turns: bool = True
    validate_chat: bool = True
    min_chars: int = 0
    max_chars: int | None = None
    min_turns: int = 0
    max_turns: int | None = None
    languages: tuple[str, ...] = ()
    min_language_confidence: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "languages", tuple(self.languages))
        kinds = {"strip_control": bool, "drop_empty_turns": bool, "validate_chat": bool,
                 "min_chars": int, "max_chars": int | None, "min_turns": int,
                 "max_turns": int | None, "min_language_confidence": int | float}  # fmt: skip
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"{name}={value!r}: expected {getattr(kind, '__name__', kind)}")
        if self.normalize is not None and self.normalize not in FORMS:
            raise ValueError(f"normalize={self.normalize!r}: use one of {FORMS} or None")
        for low, high in (("min_chars", "max_chars"), ("min_turns", "max_turns")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo < 0 or (hi is not None and hi < lo):
                raise ValueError(f"{low}={lo}, {high}={hi}: need 0 <= {low} <= {high}")
        if not 0.0 <= self.min_language_confidence <= 1.0:
            raise ValueError(
                f"min_language_confidence={self.min_language_confidence}: a probability in [0, 1]"
            )
        if any(not isinstance(c, str) or not c for c in self.languages):
            raise ValueError(f"languages={self.languages!r}: give ISO codes such as ('en', 'de')")
        if unknown := [c for c in self.languages if c not in _identifier().labels]:
            raise ValueError(f"languages {unknown} are not codes py3langid knows (ISO 639-1)")

    def replace(self, overrides: Mapping[str, Any]) -> CleanConfig:
        """This config with `overrides` ({field: value}, e.g. from JSON) applied.

        Raises:
          ValueError: a key names no field, or a value is out of range.
        """
        names = [f.name for f in dataclasses.fields(self)]
        if unknown := sorted(set(overrides) - set(names)):
            raise ValueError(f"clean options {unknown} do not exist; the options are {names}")
        return dataclasses.replace(self, **overrides)


class Cleaned(NamedTuple):
    """One record's outcome: the cleaned record (None when dropped), the reason it was dropped
    and a one-line detail, and the `MODIFICATIONS` that changed it."""

    record: dict | None
    reason: str | None = None
    detail: str = ""
    modified: tuple[str, ...] = ()


class _Drop(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def clean_record(raw: Any, config: CleanConfig) -> Cleaned:
    """Cleans one record: the bytes or text of a JSON object, or a decoded dict."""
    changes: set[str] = set()
    try:
        record = _parse(raw)
        try:
            fmt = detect_format(record)
        except RecordError as e:
            raise _Drop("unknown_format", str(e)) from None
        record, turns, text = _FORMATS[fmt](dict(record), config, changes)
        _check_bounds(config, turns, text)
        if config.languages:
            _check_language(config, text)
        try:
            json.dumps(record, ensure_ascii=False).encode()
        except (TypeError, ValueError) as e:
            raise _Drop("unencodable", str(e)) from None
    except _Drop as drop:
        return Cleaned(None, drop.reason, drop.detail)
    return Cleaned(record, modified=tuple(m for m in MODIFICATIONS if m in changes))


def _parse(raw: Any) -> Mapping:
    if isinstance(raw, bytes | str):
        try:
            raw = json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise _Drop("invalid_json", f"not JSON: {e}") from None
    if not isinstance(raw, Mapping):
        raise _Drop("invalid_json", f"a JSON {type(raw).__name__}, not an object")
    return raw


def _fix(text: str, config: CleanConfig, changes: set[str]) -> str:
    """`text` stripped of control characters and normalised, noting what changed."""
    if config.strip_control and _CONTROL.search(text):
        text = _CONTROL.sub("", text)
        changes.add("control_chars_stripped")
    if config.normalize and not text.isascii():  # ASCII is the same in every form
        normal = unicodedata.normalize(config.normalize, text)
        if normal != text:
            text = normal
            changes.add("normalized")
    return text


class _Text(NamedTuple):
    """What the bound and language rules read: every text's length, the user + assistant text."""

    chars: int
    spoken: list[str]


def _text_format(record: dict, config: CleanConfig, changes: set[str]):
    if not isinstance(record["text"], str):
        raise _Drop("malformed", f"'text' is a {type(record['text']).__name__}, not a string")
    text = record["text"] = _fix(record["text"], config, changes)
    if not text.strip():
        raise _Drop("empty", "the text is empty")
    return record, None, _Text(len(text), [text])


def _messages_format(record: dict, config: CleanConfig, changes: set[str]):
    messages = record["messages"] = _clean_messages(record["messages"], "messages", config, changes)
    return record, *_conversation(messages, config)


def _prompt_completion_format(record: dict, config: CleanConfig, changes: set[str]):
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise _Drop("malformed", "'completion' must be a string when 'prompt' is a string")
        prompt = record["prompt"] = _fix(prompt, config, changes)
        completion = record["completion"] = _fix(completion, config, changes)
        if not prompt.strip() or not completion.strip():
            raise _Drop("empty", f"the {'prompt' if not prompt.strip() else 'completion'} is empty")
        return record, 2, _Text(len(prompt) + len(completion), [prompt, completion])
    prompt = record["prompt"] = _clean_messages(prompt, "prompt", config, changes)
    if isinstance(completion, str):
        completion = record["completion"] = _fix(completion, config, changes)
        answer = [{"role": "assistant", "content": completion}] if completion.strip() else []
    else:
        answer = record["completion"] = _clean_messages(completion, "completion", config, changes)
    if not answer:
        raise _Drop("empty", "the completion is empty")
    return record, *_conversation(prompt + answer, config)


_FORMATS = {
    "text": _text_format,
    "messages": _messages_format,
    "prompt_completion": _prompt_completion_format,
}


def _clean_messages(messages: Any, key: str, config: CleanConfig, changes: set[str]) -> list:
    """The messages under `key` with their text fixed and (if configured) empty ones removed."""
    if not isinstance(messages, list):
        raise _Drop("malformed", f"{key!r} is a {type(messages).__name__}, not a list of messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise _Drop("malformed", f"{key}[{i}] is not a {{'role', 'content'}} object")
        message = dict(message)
        content = message["content"]
        if content is not None and not isinstance(content, str):
            kind = type(content).__name__
            raise _Drop("malformed", f"{key}[{i}] content is a {kind}, not a string or null")
        for field in ("content", *REASONING_FIELDS):
            if isinstance(message.get(field), str):
                message[field] = _fix(message[field], config, changes)
        if config.drop_empty_turns and _is_empty(message):
            changes.add("empty_turns_removed")
            continue
        out.append(message)
    return out


def _is_empty(message: dict) -> bool:
    texts = (message.get(f) for f in ("content", *REASONING_FIELDS))
    return not message.get("tool_calls") and not any(
        isinstance(t, str) and t.strip() for t in texts
    )


def _conversation(messages: list[dict], config: CleanConfig) -> tuple[int, _Text]:
    """The turn count and text of a conversation, after its emptiness and structure checks."""
    roles = [m.get("role") for m in messages]
    if "user" not in roles or "assistant" not in roles:
        raise _Drop("empty", f"no {'user' if 'user' not in roles else 'assistant'} turn")
    if config.validate_chat and (problem := chat_problem(messages)):
        raise _Drop(*problem)
    texts = [m.get(f) for m in messages for f in ("content", *REASONING_FIELDS)]
    chars = sum(len(t) for t in texts if isinstance(t, str))
    spoken = [m["content"] for m in messages if m["role"] in ("user", "assistant") and m["content"]]
    return sum(r in ("user", "assistant") for r in roles), _Text(chars, spoken)


def _check_bounds(config: CleanConfig, turns: int | None, text: _Text) -> None:
    if turns is not None and turns < config.min_turns:
        raise _Drop("too_few_turns", f"{turns} turns < min_turns={config.min_turns}")
    if turns is not None and config.max_turns is not None and turns > config.max_turns:
        raise _Drop("too_many_turns", f"{turns} turns > max_turns={config.max_turns}")
    if text.chars < config.min_chars:
        raise _Drop("too_short", f"{text.chars} characters < min_chars={config.min_chars}")
    if config.max_chars is not None and text.chars > config.max_chars:
        raise _Drop("too_long", f"{text.chars} characters > max_chars={config.max_chars}")


_IDENTIFIER = None  # py3langid's model, loaded once per process


def _identifier():
    global _IDENTIFIER
    if _IDENTIFIER is None:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        _IDENTIFIER = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _IDENTIFIER


def language(text: str) -> tuple[str, float]:
    """py3langid's language of `text` (its first `LANGUAGE_CHARS` characters) and normalised
    probability."""
    return _identifier().classify(text[:LANGUAGE_CHARS])


def _check_language(config: CleanConfig, text: _Text) -> None:
    code, probability = language("\n".join(text.spoken))
    if code not in config.languages:
        raise _Drop("language", f"{code} ({probability:.2f}), not one of {config.languages}")
    if probability < config.min_language_confidence:
        raise _Drop(
            "language",
            f"{code} with probability {probability:.2f} < {config.min_language_confidence}",
        )


def _clean_chunk(task: tuple[CleanConfig, list]) -> list[Cleaned]:
    config, raws = task
    return [clean_record(raw, config) for raw in raws]


def _ordered_map(workers: int, tasks: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, list]]:
    """(meta, _clean_chunk(payload)) for each (meta, payload) of `tasks`, in order, with at most
    2 chunks per worker in flight (Pool.imap would read the whole input ahead)."""
    if workers <= 1:
        for meta, payload in tasks:
            yield meta, _clean_chunk(payload)
        return
    # Not fork: a forked child of a process running JAX's threads can deadlock. The fork server
    # imports this module (and JAX, through posttrain.data) once, then forks each worker from
    # it: one import per process that cleans instead of one per worker, and shared pages.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # no effect once this process's server runs
    with context.Pool(workers) as pool:
        pending: collections.deque = collections.deque()
        for meta, payload in tasks:
            pending.append((meta, pool.apply_async(_clean_chunk, (payload,))))
            if len(pending) >= 2 * workers:
                meta, result = pending.popleft()
                yield meta, result.get()
        while pending:
            meta, result = pending.popleft()
            yield meta, result.get()


def _counts(names: Sequence[str], counter: collections.Counter) -> dict[str, int]:
    return {n: counter[n] for n in names if counter[n]}


def clean(
    sources: Iterable[str | tuple[str, CleanConfig | None]],
    out: str,
    config: CleanConfig | None = None,
    *,
    rejects: str | None = None,
    workers: int | None = None,
    chunk_size: int = 256,
    progress: bool = False,
) -> dict[str, Any]:
    """Cleans `sources` into one output file, streaming, on `workers` processes.

    Args:
      sources: files or globs (JSON lines, Parquet, ArrayRecord; local or gs://), each a pattern
        or (pattern, its CleanConfig or None for `config`). Output keeps their order.
      out: the output file; its suffix picks the format (.jsonl, .parquet, .arrayrecord).
      config: the rules of sources without their own (default `CleanConfig()`).
      rejects: a .jsonl file to write each dropped record to, as {"reason", "detail", "source",
        "location", "record"} ("raw" text instead of "record" for invalid JSON).
      workers: processes (None or 0: os.cpu_count(); 1 cleans in this process).
      chunk_size: records sent to a worker at a time.
      progress: show a progress bar (on a terminal).

    Returns:
      {"read", "kept", "dropped": {reason: n}, "modified": {modification: n}, "sources":
      [{"pattern", "config", "read", "kept", "dropped", "modified"}, ...]}, reasons in `REASONS`
      order and modifications in `MODIFICATIONS` order, zero counts left out.

    Raises:
      FileNotFoundError: a source matches no file.
      ValueError: a source has an unsupported suffix or holds no records, or `rejects` is not
        .jsonl.
    """
    default = config or CleanConfig()
    plan = [(s, None) if isinstance(s, str) else tuple(s) for s in sources]
    plan = [(pattern, c or default) for pattern, c in plan]
    if not plan:
        raise ValueError("clean needs at least one source")
    kind_of(out)  # an unsupported suffix fails before the sources are read
    if rejects is not None and Path(rejects).suffix.lower() != ".jsonl":
        raise ValueError(f"rejects={rejects}: write rejected records to a .jsonl file")
    readers = [Records(pattern) for pattern, _ in plan]
    per_source = [
        {"read": 0, "kept": 0, "dropped": collections.Counter(), "modified": collections.Counter()}
        for _ in plan
    ]

    def tasks():
        for index, ((_, c), records) in enumerate(zip(plan, readers, strict=True)):
            for start in range(0, len(records), chunk_size):
                items = [records[i] for i in range(start, min(start + chunk_size, len(records)))]
                yield (index, items), (c, [raw for raw, _ in items])

    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(RecordWriter(out))
        side = stack.enter_context(RecordWriter(rejects)) if rejects else None
        bar = stack.enter_context(
            tqdm(
                total=sum(map(len, readers)),
                unit="rec",
                desc="clean",
                disable=None if progress else True,
            )
        )
        for (index, items), results in _ordered_map(workers or os.cpu_count() or 1, tasks()):
            stats = per_source[index]
            for (raw, where), result in zip(items, results, strict=True):
                stats["read"] += 1
                if result.record is None:
                    stats["dropped"][result.reason] += 1
                    if side is not None:
                        side.write(_reject(result, plan[index][0], where, raw))
                    continue
                stats["kept"] += 1
                stats["modified"].update(result.modified)
                writer.write(result.record)
            bar.update(len(items))
    return _summary(plan, per_source)


def _reject(result: Cleaned, source: str, where: str, raw: Any) -> dict[str, Any]:
    """A rejects-file line: the record as read, or its raw text where JSON cannot hold it."""
    reject = {"reason": result.reason, "detail": result.detail, "source": source, "location": where}
    if result.reason not in ("invalid_json", "unencodable"):
        return {**reject, "record": _parse(raw)}
    return {**reject, "raw": raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)}


def _summary(plan: list, per_source: list[dict]) -> dict[str, Any]:
    dropped, modified = collections.Counter(), collections.Counter()
    sources = []
    for (pattern, config), stats in zip(plan, per_source, strict=True):
        dropped.update(stats["dropped"])
        modified.update(stats["modified"])
        sources.append({
            "pattern": pattern,
            "config": dataclasses.asdict(config),
            "read": stats["read"],
            "kept": stats["kept"],
            "dropped": _counts(REASONS, stats["dropped"]),
            "modified": _counts(MODIFICATIONS, stats["modified"]),
        })  # fmt: skip
    return {
        "read": sum(s["read"] for s in sources),
        "kept": sum(s["kept"] for s in sources),
        "dropped": _counts(REASONS, dropped),
        "modified": _counts(MODIFICATIONS, modified),
        "sources": sources,
    }
