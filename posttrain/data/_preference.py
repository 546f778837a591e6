"""Preference pairs: `{"prompt", "chosen", "rejected"}` records -> fixed-shape numpy batches.

A record's prompt and responses follow the SFT prompt-completion format (`_formats`): a string
prompt with string responses is encoded as text (the prompt as the tokenizer encodes text, each
response without special tokens, then EOS); a message-list prompt is rendered with the chat
template and its generation prompt, and each response (a string, or a list of assistant
messages) completes it, masked as `Tokenizer.encode_chat` masks assistant turns (content and
end-of-turn token). Both sequences of a pair share the prompt's tokens; the loss mask covers the
response tokens only. An optional string `domain` names the record's domain.

This is a plain, deterministic Python iterator over an in-memory list or a JSONL file; like SFT,
it will move onto Grain (checkpointable iterator state, sharding over processes, mixtures).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.data._formats import RecordError, decode, encode_record, to_example
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
) -> dict[str, Any] | None:
    """Tokenizes one preference record into its chosen and rejected sequences.

    Args:
      tokenizer: the tokenizer (its chat template renders message prompts).
      record: the record, or its JSON text.
      max_len: the most tokens of each sequence.
      overlong: a sequence longer than max_len is cut to it ("truncate") or the pair is left
        out ("drop": returns None).
      add_eos: append EOS to string responses of string prompts.

    Returns:
      {"chosen": arrays, "rejected": arrays, "truncated": bool, "domain": str | None}, where
      arrays are `to_example`'s unpadded `tokens`, `targets`, `loss_mask` of one sequence; or
      None for a pair dropped as overlong.

    Raises:
      PairError: the record is malformed (a missing or mistyped field), a response is empty,
        chosen and rejected are the same tokens, or truncation leaves a side no response token;
        `reason` says which.
    """
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r}: use 'truncate' or 'drop'")
    try:
        record = decode(record)
        missing = [k for k in ("prompt", *SIDES) if k not in record]
        if missing:
            raise RecordError(f"missing key(s) {missing}; expected {EXPECTED}")
        domain = record.get("domain")
        if domain is not None and not isinstance(domain, str):
            raise RecordError(f"'domain' must be a string, got {type(domain).__name__}")
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
    except RecordError as e:
        raise PairError(str(e), "malformed") from None
    if encoded["chosen"][0] == encoded["rejected"][0]:
        raise PairError("'chosen' and 'rejected' are the same tokens", "identical")
    truncated = any(len(ids) > max_len for ids, _ in encoded.values())
    if truncated and overlong == "drop":
        return None
    out = {"truncated": truncated, "domain": domain}
    for side, (ids, trained) in encoded.items():
        out[side] = to_example(ids[:max_len], trained[:max_len])
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


class PreferenceData:
    """Iterator of preference batches (see `preference_batches`); `stats` counts the records.

    Every record is encoded once, up front, so bad records are counted (or raised) before the
    first batch; each epoch then visits the kept pairs in a fresh seeded order.
    """

    def __init__(
        self,
        records,
        tokenizer,
        *,
        max_len,
        batch_size,
        seed,
        shuffle,
        num_epochs,
        on_error,
        overlong,
        add_eos,
        domains,
    ):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        if max_len < 2 or batch_size < 1:
            raise ValueError(
                f"max_len must be >= 2 and batch_size >= 1, got {max_len}, {batch_size}"
            )
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
        self.max_len, self.batch_size, self.seed = max_len, batch_size, seed
        self.shuffle, self.num_epochs = shuffle, num_epochs
        counts = dict.fromkeys(("read", "used", "truncated", *_REASONS), 0)
        errors: list[str] = []
        pairs = []
        for index, raw in enumerate(_read(records)):
            counts["read"] += 1
            try:
                pair = encode_pair(
                    tokenizer, raw, max_len=max_len, overlong=overlong, add_eos=add_eos
                )
            except PairError as e:
                if on_error == "raise":
                    raise PairError(
                        f"preference record {index}: {e}. Fix the record, or pass "
                        "on_error='skip' to skip and count bad pairs.",
                        e.reason,
                    ) from None
                counts[e.reason] += 1
                if len(errors) < _KEPT_ERRORS:
                    errors.append(f"record {index}: {e}")
                continue
            if pair is None:
                counts["dropped"] += 1
                continue
            counts["used"] += 1
            counts["truncated"] += pair["truncated"]
            pairs.append(pair)
        if not pairs:
            raise ValueError(
                f"no usable preference pair in {counts['read']} records ({counts}); "
                f"first errors: {errors[:3]}"
            )
        names = sorted({p["domain"] or "" for p in pairs}) if domains is None else list(domains)
        index_of = {name: i for i, name in enumerate(names)}
        for pair in pairs:
            name = pair["domain"] or ""
            if name not in index_of:
                raise ValueError(f"record domain {name!r} is not in domains={names}")
            pair["domain_id"] = index_of[name]
        skipped = sum(counts[r] for r in _REASONS)
        if skipped:
            _log.warning(
                "left out %d of %d preference records: %s",
                skipped,
                counts["read"],
                {r: counts[r] for r in _REASONS if counts[r]},
            )
        self.pairs = pairs
        self.stats = {**counts, "domains": names, "errors": errors}
        self._order = self._indices()

    def _indices(self) -> Iterator[int]:
        epoch = 0
        while self.num_epochs is None or epoch < self.num_epochs:
            order = list(range(len(self.pairs)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            yield from order
            epoch += 1

    def __iter__(self) -> PreferenceData:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rows = [self.pairs[i] for _, i in zip(range(self.batch_size), self._order, strict=False)]
        if not rows:
            raise StopIteration
        return collate(rows, self.max_len, self.batch_size)


def collate(pairs: Sequence[Mapping[str, Any]], max_len: int, rows: int) -> dict[str, np.ndarray]:
    """`encode_pair` outputs -> `[rows, max_len]` arrays, one pair per row, right-padded.

    Rows past `len(pairs)` are empty (segment id 0, no loss), so they count as no pair.
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
    batch["domain_ids"] = np.zeros(rows, np.int32)
    batch["domain_ids"][: len(pairs)] = [p.get("domain_id", 0) for p in pairs]
    return batch


def _read(records) -> Iterator[Any]:
    """Records from a list, or the lines of a JSONL file (blank lines skipped)."""
    if isinstance(records, str | Path):
        with open(records, encoding="utf-8") as f:
            yield from (line for line in f if line.strip())
    else:
        yield from records


def preference_batches(
    records: Sequence[Any] | str | Path,
    tokenizer: Tokenizer,
    *,
    max_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    on_error: str = "skip",
    overlong: str = "truncate",
    add_eos: bool = True,
    domains: Sequence[str] | None = None,
) -> PreferenceData:
    """Batches of preference pairs for DPO and its variants.

    Args:
      records: record dicts (or their JSON text), or a JSONL file's path.
      tokenizer: the tokenizer.
      max_len: row length L of every array.
      batch_size: rows B per batch, one pair per row.
      seed: seeds the per-epoch shuffles; same records and seed give the same batches.
      shuffle: visit pairs in a fresh seeded order each epoch; else in record order.
      num_epochs: None repeats forever; n stops after n passes (the last batch padded with
        empty rows).
      on_error: "skip" counts bad records in `stats` (malformed, empty, identical, no_loss);
        "raise" raises `PairError` naming the record's index.
      overlong: pairs with a sequence over max_len are truncated or dropped (both counted).
      add_eos: append EOS to string responses of string prompts.
      domains: domain names, their order giving `domain_ids`; default: the sorted names in the
        records ("" for records without one).

    Returns:
      A `PreferenceData` iterator of dicts of numpy arrays: `{side}_tokens`, `{side}_targets`,
      `{side}_positions`, `{side}_segment_ids` (int32) and `{side}_loss_mask` (float32), each
      `[B, L]`, for side in chosen/rejected (segment id 1 on tokens, 0 on padding), and
      `domain_ids [B]`. Its `stats` dict counts read, used, truncated, dropped and each bad-record
      reason, and keeps the domain names and the first error messages.
    """
    return PreferenceData(
        records,
        tokenizer,
        max_len=max_len,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        on_error=on_error,
        overlong=overlong,
        add_eos=add_eos,
        domains=domains,
    )
