"""SFT record formats: a record to token ids and the mask of the tokens trained on.

- `{"messages": [...], "tools"?: [...]}`: rendered with the chat template; loss on the
  assistant turns (content and end-of-turn token), as `Tokenizer.encode_chat` marks them.
- `{"prompt": str, "completion": str}`: the prompt encoded as the tokenizer encodes text (BOS if
  its post-processor adds one), the completion encoded without special tokens and appended, then
  EOS; loss on the completion and EOS. The two are tokenized separately, so the boundary is
  always a token boundary.
- `{"prompt": [messages], "completion": str | [messages]}`: the prompt rendered with the
  generation prompt; loss on the assistant reply that completes it.
- `{"text": str}`: encoded as the tokenizer encodes text, then EOS; every token is trained on
  (the first has nothing before it to predict it).

For a vision-language model, messages may hold image parts and text image markers with an
"images" list (`_image_chat`); each example then carries its images' pixels.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import numpy as np

from posttrain.data._image_chat import (
    ImageRecordError,
    ImageSpec,
    flatten_record,
    has_images,
    load_pixels,
    no_pixels,
    whole_images_cut,
)
from posttrain.data._tokenizer import Tokenizer

EXPECTED = {
    "messages": '{"messages": [{"role": ..., "content": ...}, ...]}',
    "prompt_completion": '{"prompt": str or messages, "completion": str or messages}',
    "text": '{"text": str}',
}


class RecordError(ValueError):
    """A malformed record; the message says what was expected (the caller adds where)."""


# The fields that hold a record's text (and so may place images).
TEXT_KEYS = ("messages", "prompt", "completion", "text", "chosen", "rejected")


def decode(raw: Any) -> Mapping[str, Any]:
    """A record's JSON object (from bytes, or a Parquet row dict as is)."""
    if isinstance(raw, bytes | str):
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RecordError(f"invalid JSON ({e}); expected one JSON object per record") from e
    if not isinstance(raw, Mapping):
        raise RecordError(
            f"expected a JSON object, got a {type(raw).__name__} (JSON lines files hold one "
            "object per line, not an array)"
        )
    return raw


def detect_format(record: Mapping[str, Any]) -> str:
    """The format a record's keys select: messages, prompt_completion or text."""
    if "messages" in record:
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise RecordError(
        f"record has keys {sorted(record)[:8]}, which match no format; expected "
        + " or ".join(EXPECTED.values())
    )


def encode_record(
    record: Mapping[str, Any], fmt: str, tokenizer: Tokenizer, *, add_eos: bool
) -> tuple[list[int], list[bool]]:
    """Tokenizes one record.

    Args:
      record: the decoded record.
      fmt: "auto" (detect from the keys) or one of `EXPECTED`.
      tokenizer: the tokenizer (its chat template renders messages).
      add_eos: append EOS to text and to string completions.

    Returns:
      (ids, trained): token ids, and per token whether it is a target the loss is computed on.

    Raises:
      RecordError: the record does not hold the format's fields with the right types, or its
        conversation cannot be rendered.
    """
    fmt = detect_format(record) if fmt == "auto" else fmt
    try:
        if fmt == "messages":
            return _messages(record, tokenizer)
        if fmt == "prompt_completion":
            return _prompt_completion(record, tokenizer, add_eos)
        return _text(record, tokenizer, add_eos)
    except RecordError as e:
        raise RecordError(f"{e} (format {fmt}: expected {EXPECTED[fmt]})") from None


def _field(record: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in record:
        raise RecordError(f"missing key {key!r}")
    value = record[key]
    if not isinstance(value, types):
        raise RecordError(f"{key!r} must be {what}, got {type(value).__name__}")
    return value


def _chat(tokenizer: Tokenizer, fn, *args, **kwargs):
    """Runs a chat-template call, reporting conversations it cannot render as record errors."""
    if not tokenizer.chat_templates:
        # A tokenizer without a template is a configuration error, not a bad record.
        raise ValueError(
            f"{tokenizer.name_or_path} has no chat template, so chat records cannot be "
            "rendered; use a tokenizer with one, or text/prompt-completion data"
        )
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise RecordError(f"the chat template cannot render it: {e}") from e


def _messages(record, tokenizer):
    messages = _field(record, "messages", list, "a list of messages")
    tools = record.get("tools")
    return _chat(tokenizer, tokenizer.encode_chat, messages, tools=tools)


def encode_prompt(record: Mapping[str, Any], tokenizer: Tokenizer) -> list[int]:
    """The ids a model continues from: a string `prompt` as the tokenizer encodes text, a list of
    messages through the chat template with its generation prompt (and the record's `tools`).

    Raises:
      RecordError: `prompt` is missing or neither a string nor messages, or the template fails.
    """
    prompt = _field(record, "prompt", (str, list), "a string or a list of messages")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return _chat(
        tokenizer,
        tokenizer.apply_chat_template,
        prompt,
        add_generation_prompt=True,
        tools=record.get("tools"),
    )


def _prompt_completion(record, tokenizer, add_eos):
    prompt = _field(record, "prompt", (str, list), "a string or a list of messages")
    completion = _field(record, "completion", (str, list), "a string or a list of messages")
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise RecordError("'completion' must be a string when 'prompt' is a string")
        prompt_ids = encode_prompt(record, tokenizer)
        completion_ids = tokenizer.encode(completion, add_special_tokens=False)
        completion_ids += _eos(tokenizer, completion_ids, add_eos)
        ids = prompt_ids + completion_ids
        return ids, [False] * len(prompt_ids) + [True] * len(completion_ids)
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    tools = record.get("tools")
    prompt_ids = encode_prompt(record, tokenizer)
    ids, assistant = _chat(tokenizer, tokenizer.encode_chat, prompt + completion, tools=tools)
    # Assistant turns inside the prompt (few-shot examples) are context, not targets.
    return ids, [a and i >= len(prompt_ids) for i, a in enumerate(assistant)]


def _text(record, tokenizer, add_eos):
    text = _field(record, "text", str, "a string")
    ids = tokenizer.encode(text)
    ids += _eos(tokenizer, ids, add_eos)
    return ids, [False] + [True] * (len(ids) - 1)


def _eos(tokenizer: Tokenizer, ids: list[int], add_eos: bool) -> list[int]:
    """[EOS] if it should be appended and is not already there."""
    return [tokenizer.eos_id] if add_eos and (not ids or ids[-1] != tokenizer.eos_id) else []


def to_example(ids: Sequence[int], trained: Sequence[bool]) -> dict[str, np.ndarray]:
    """Next-token arrays of one document: tokens, targets and loss_mask.

    targets[i] is ids[i + 1] (0 after the last token); loss_mask[i] is 1.0 where that target is
    trained on, so the last token of a document never predicts across into the next one.
    """
    tokens = np.asarray(ids, np.int32)
    targets = np.zeros_like(tokens)
    targets[:-1] = tokens[1:]
    loss_mask = np.zeros(len(tokens), np.float32)
    loss_mask[:-1] = np.asarray(trained[1:], np.float32)
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class ExampleEncoder:
    """Raw record -> one document's arrays, or a marker saying why it is left out (a Grain map).

    Returns {"example": to_example(...) + domain_ids, "source", "truncated"}, or {"status":
    "skipped" | "dropped" | "no_loss", "source", ...} for a record that yields no example.
    """

    tokenizer: Tokenizer
    fmt: str
    max_len: int
    source: int = 0  # index of the source in the mixture, carried for accounting
    domain: int = 0  # domain index written into `domain_ids`
    add_eos: bool = True
    on_error: str = "raise"
    overlong: str = "truncate"

    images: ImageSpec | None = None  # a VLM's images; None: a text model (images refused)
    image_root: str | None = None  # the directory relative image paths resolve against

    def __call__(self, item: tuple[Any, str]) -> dict[str, Any]:
        raw, where = item
        try:
            record, refs = self._record(decode(raw))
            ids, trained = encode_record(record, self.fmt, self.tokenizer, add_eos=self.add_eos)
            cut, n_images = len(ids), 0
            if self.images is not None:
                cut, n_images = whole_images_cut(ids, self.max_len, self.images)
            cut = min(cut, self.max_len)
            truncated = len(ids) > cut
            if truncated and self.overlong == "drop":
                return {"status": "dropped", "source": self.source}
            example = to_example(ids[:cut], trained[:cut])
            if not example["loss_mask"].any():
                return {"status": "no_loss", "source": self.source, "truncated": truncated}
            if self.images is not None:
                example["images"] = (
                    load_pixels(refs[:n_images], self.images, self.image_root)
                    if n_images
                    else no_pixels(self.images)
                )
        except (RecordError, ImageRecordError) as e:
            if self.on_error == "raise":
                raise RecordError(
                    f"{where}: {e}. Fix the record, or set on_error='skip' to skip and "
                    "count malformed records."
                ) from None
            return {"status": "skipped", "source": self.source, "error": f"{where}: {e}"}
        example["domain_ids"] = np.full(len(example["tokens"]), self.domain, np.int32)
        return {"source": self.source, "truncated": truncated, "example": example}

    def _record(self, record: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[Any]]:
        """The record with its images placed as image tokens, and their refs."""
        if self.images is not None:
            return flatten_record(record, self.images, TEXT_KEYS)
        if has_images(record, TEXT_KEYS):
            raise RecordError(
                "the record has images, but the model has no vision tower; train a "
                "vision-language model on it, or leave the images out"
            )
        return record, []
