"""Preference pairs: a `{"prompt", "chosen", "rejected"}` record -> chosen/rejected arrays.

A record's prompt and responses follow the SFT prompt-completion format (`_formats`): a string
prompt with string responses is encoded as text (the prompt as the tokenizer encodes text, each
response without special tokens, then EOS); a message-list prompt is rendered with the chat
template and its generation prompt, and each response (a string, or a list of assistant
messages) completes it, masked as `Tokenizer.encode_chat` masks assistant turns (content and
end-of-turn token). Both sequences of a pair share the prompt's tokens; the loss mask covers the
response tokens only. An optional string `domain` names the record's domain, and an optional
number `margin` says by how much chosen beats rejected (reward-model training, graded labels).

Batches of pairs come from `_preference_data` (`make_preference_pipeline`, `preference_batches`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain.data._formats import TEXT_KEYS, RecordError, decode, encode_record, to_example
from posttrain.data._image_chat import (
    ImageRecordError,
    ImageSpec,
    flatten_record,
    has_images,
    pixel_rows,
    prompt_pixels,
    whole_images_cut,
)
from posttrain.data._tokenizer import Tokenizer

_log = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")
FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")
EXPECTED = '{"prompt": str or messages, "chosen": str or messages, "rejected": str or messages}'
# Why a record yields no pair; each is counted in `PreferenceData.stats`.
_REASONS = ("malformed", "empty", "identical", "dropped", "no_loss")
_KEPT_ERRORS = 10


class PairError(RecordError):
    """A record that yields no pair; `reason` is one of `_REASONS`."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def encode_pair(
    tokenizer: Tokenizer,
    record: Mapping[str, Any] | str | bytes,
    *,
    max_len: int,
    overlong: str = "truncate",
    add_eos: bool = True,
    images: ImageSpec | None = None,
) -> dict[str, Any] | None:
    """Tokenizes one preference record into its chosen and rejected sequences.

    Args:
      tokenizer: the tokenizer (its chat template renders message prompts).
      record: the record, or its JSON text.
      max_len: the most tokens of each sequence.
      overlong: a sequence longer than max_len is cut to it ("truncate") or the pair is left
        out ("drop": returns None).
      add_eos: append EOS to string responses of string prompts.
      images: a VLM's `ImageSpec`: the record may place images (`_image_chat`), which both
        sides read; a text model's pair with images is malformed.

    Returns:
      {"chosen": arrays, "rejected": arrays, "truncated": bool, "domain": str | None,
      "margin": float (0 if the record has none), "images": the refs of the images both sides
      keep (with `images`)}, where
      arrays are `to_example`'s unpadded `tokens`, `targets`, `loss_mask` of one sequence; or
      None for a pair dropped as overlong.

    Raises:
      PairError: the record is malformed (a missing or mistyped field), a response is empty,
        chosen and rejected are the same tokens, or truncation leaves a side no response token;
        `reason` says which.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r}: use 'truncate' or 'drop'")
    refs = []
    try:
        record = decode(record)
        if images is not None:
            record, refs = flatten_record(record, images, TEXT_KEYS)
        elif has_images(record, TEXT_KEYS):
            raise RecordError("the pair has images, but the model has no vision tower")
        missing = [k for k in ("prompt", *SIDES) if k not in record]
        if missing:
            raise RecordError(f"missing key(s) {missing}; expected {EXPECTED}")
        domain = record.get("domain")
        if domain is not None and not isinstance(domain, str):
            raise RecordError(f"'domain' must be a string, got {type(domain).__name__}")
        margin = record.get("margin", 0.0)
        number = isinstance(margin, int | float) and not isinstance(margin, bool)
        if not number or not math.isfinite(margin):
            raise RecordError(f"'margin' must be a finite number, got {margin!r}")
        prompt = record["prompt"]
        if not isinstance(prompt, str | list):
            raise RecordError(f"'prompt' must be a string or messages, got {type(prompt).__name__}")
        for side in SIDES:
            if not isinstance(record[side], str | list):
                raise RecordError(
                    f"{side!r} must be a string or messages, got {type(record[side]).__name__}"
                )
            if isinstance(prompt, str) and not isinstance(record[side], str):
                raise RecordError(f"{side!r} must be a string when 'prompt' is a string")
        encoded = {}
        for side in SIDES:
            if _is_empty(record[side]):
                raise PairError(f"empty {side!r} response", "empty")
            pc = {"prompt": prompt, "completion": record[side]}
            try:
                encoded[side] = encode_record(pc, "prompt_completion", tokenizer, add_eos=add_eos)
            except RecordError as e:
                raise RecordError(f"{side!r}: {e}") from None
    except PairError:
        raise
    except (RecordError, ImageRecordError) as e:
        raise PairError(str(e), "malformed") from None
    if encoded["chosen"][0] == encoded["rejected"][0]:
        raise PairError("'chosen' and 'rejected' are the same tokens", "identical")
    cuts = {side: (max_len, 0) for side in SIDES}
    if images is not None:  # never split an image; both sides keep the images both hold
        cuts = {side: whole_images_cut(ids, max_len, images) for side, (ids, _) in encoded.items()}
        both = dataclasses.replace(images, max_images=min(n for _, n in cuts.values()))
        cuts = {side: whole_images_cut(ids, max_len, both) for side, (ids, _) in encoded.items()}
    truncated = any(len(ids) > cuts[side][0] for side, (ids, _) in encoded.items())
    if truncated and overlong == "drop":
        return None
    out = {"truncated": truncated, "domain": domain, "margin": float(margin)}
    if images is not None:
        out["images"] = refs[: min(n for _, n in cuts.values())]
    for side, (ids, trained) in encoded.items():
        out[side] = to_example(ids[: cuts[side][0]], trained[: cuts[side][0]])
        if not out[side]["loss_mask"].any():
            raise PairError(
                f"truncating to max_len={max_len} leaves {side!r} no response token; raise "
                "max_len or shorten the prompt",
                "no_loss",
            )
    return out


def _is_empty(response: Any) -> bool:
    """A response with no text: "", [], or messages whose contents are all blank."""
    if isinstance(response, str):
        return not response.strip()
    if isinstance(response, list):
        return all(
            isinstance(m, Mapping) and not str(m.get("content") or "").strip() for m in response
        )
    return False


def collate(
    pairs: Sequence[Mapping[str, Any]],
    max_len: int,
    rows: int,
    images: ImageSpec | None = None,
) -> dict[str, np.ndarray]:
    """`encode_pair` outputs -> `[rows, max_len]` arrays, one pair per row, right-padded; with
    `images`, also the pairs' `images` `[rows, max_images, S, S, C]` (both sides read them).

    Rows past `len(pairs)` are empty (segment id 0, no loss, domain id -1): they count as no pair.
    """
    batch = {}
    for side in SIDES:
        arrays = {name: np.zeros((rows, max_len), np.int32) for name in FIELDS}
        arrays["loss_mask"] = np.zeros((rows, max_len), np.float32)
        for r, pair in enumerate(pairs):
            n = len(pair[side]["tokens"])
            for name in ("tokens", "targets", "loss_mask"):
                arrays[name][r, :n] = pair[side][name]
            arrays["positions"][r, :n] = np.arange(n)
            arrays["segment_ids"][r, :n] = 1
        batch.update({f"{side}_{name}": value for name, value in arrays.items()})
    batch["domain_ids"] = np.full(rows, -1, np.int32)
    batch["domain_ids"][: len(pairs)] = [p.get("domain_id", 0) for p in pairs]
    batch["margins"] = np.zeros(rows, np.float32)
    batch["margins"][: len(pairs)] = [p.get("margin", 0.0) for p in pairs]
    if images is not None:
        batch["images"] = pixel_rows([prompt_pixels(p, images) for p in pairs], images, rows)
    return batch
