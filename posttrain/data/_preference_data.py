"""Preference batches: the kept pairs of this process's share of the sources, drawn by a Grain
graph whose position is saved with every checkpoint (`make_preference_pipeline` for a
`DataConfig`, `preference_batches` for records in memory)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from posttrain.data._accounting import log_source, source_names, zero_counts
from posttrain.data._accounting import metrics as count_metrics
from posttrain.data._data_config import _RUNTIME_FIELDS, DataConfig, without_new_defaults
from posttrain.data._image_chat import ImageSpec, image_root, vision_spec
from posttrain.data._manifest import data_manifest
from posttrain.data._mixing import index_mixture
from posttrain.data._pipeline import process_share
from posttrain.data._preference import (
    _KEPT_ERRORS,
    _REASONS,
    EXPECTED,
    SIDES,
    PairError,
    collate,
    encode_pair,
)
from posttrain.data._sources import Records, canonical_identity
from posttrain.data._tokenizer import Tokenizer
from posttrain.models import VisionConfig

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Source:
    """Records of one source: a sequence of (raw record, location), the domain of records that
    name none, the source's mixture weight and its path (what log lines call it)."""

    records: Sequence[tuple[Any, str]]
    domain: str | None = None
    weight: float = 1.0
    path: str = "records"


class PreferenceData:
    """This process's stream of preference batches; build it with `make_preference_pipeline`
    (the sources of a `DataConfig`) or `preference_batches` (records in memory, or one file).

    Every record of this process's shard (records `process_index::process_count` of each source)
    is encoded once, up front, so bad records are counted, or raised, before the first batch.
    Batches then come from a Grain graph over the kept pairs: per-epoch seeded shuffles, sources
    mixed by weight (repeating forever) or concatenated (`num_epochs` passes), one pair per row.
    Its position is a small dict (`get_state`/`set_state`) saved with every checkpoint.

    Iterating yields dicts of numpy arrays: `{side}_tokens`, `{side}_targets`,
    `{side}_positions`, `{side}_segment_ids` (int32) and `{side}_loss_mask` (float32), each
    `[rows, max_len]`, for side in chosen/rejected (segment id 1 on tokens, 0 on padding);
    `domain_ids [rows]` (-1 on filler rows); `margins [rows]` (float32, the records' `margin`,
    0 if absent); and, once `set_reference` was called,
    `ref_chosen_logps` / `ref_rejected_logps` `[rows]` float32.

    Attributes:
      pairs: the kept pairs (`encode_pair` outputs plus `domain_id`), in record order.
      domains: domain names; `domain_ids` index them.
      rows: rows per batch on this process.
      stats: counts of read, used (kept), truncated, dropped and each bad-record reason
        (malformed, empty, identical, no_loss), skipped (malformed, empty or identical),
        `domains` ({name: pairs kept}), `sources` ({source name: its read, used, skipped,
        truncated, dropped and no_loss}) and the first error messages. Each record of the share
        counts once: pairs are encoded once, before the first batch.
      source_names: each source's name in `stats["sources"]` and in metrics
        (`posttrain.data._source_names`).
    """

    def __init__(
        self,
        sources: Sequence[_Source],
        tokenizer: Tokenizer,
        *,
        max_len: int,
        rows: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        on_error: str = "skip",
        overlong: str = "truncate",
        add_eos: bool = True,
        domains: Sequence[str] | None = None,
        process_index: int = 0,
        process_count: int = 1,
        identity: Any = None,
        images: ImageSpec | None = None,
    ):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}: use 'raise' or 'skip'")
        if max_len < 2 or rows < 1:
            raise ValueError(f"max_len must be >= 2 and batch rows >= 1, got {max_len}, {rows}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be None or >= 1, got {num_epochs}")
        self.max_len, self.rows, self.seed, self.images = max_len, rows, seed, images
        self.shuffle, self.num_epochs = shuffle, num_epochs
        self.source_names = tuple(source_names([s.path for s in sources]))
        counts = dict.fromkeys(("read", "used", "truncated", *_REASONS), 0)
        per_source = [zero_counts() for _ in sources]
        errors: list[str] = []
        self.pairs: list[dict[str, Any]] = []
        members: list[list[int]] = []  # indices into self.pairs, per source
        total = sum(len(range(process_index, len(s.records), process_count)) for s in sources)
        bar = tqdm(total=total, desc="encoding pairs", disable=total < 20_000, leave=False)
        for source, mine in zip(sources, per_source, strict=True):
            members.append([])
            for i in range(process_index, len(source.records), process_count):
                raw, where = source.records[i]
                counts["read"] += 1
                mine["read"] += 1
                bar.update(1)
                try:
                    pair = encode_pair(
                        tokenizer, raw, max_len=max_len, overlong=overlong, add_eos=add_eos,
                        images=images,
                    )  # fmt: skip
                except PairError as e:
                    if on_error == "raise":
                        raise PairError(
                            f"preference {where}: {e}. Fix the record, or set on_error='skip' "
                            "to skip and count bad pairs.",
                            e.reason,
                        ) from None
                    counts[e.reason] += 1
                    mine[e.reason if e.reason in ("dropped", "no_loss") else "skipped"] += 1
                    if len(errors) < _KEPT_ERRORS:
                        errors.append(f"{where}: {e}")
                    continue
                if pair is None:
                    counts["dropped"] += 1
                    mine["dropped"] += 1
                    continue
                counts["used"] += 1
                counts["truncated"] += pair["truncated"]
                mine["used"] += 1
                mine["truncated"] += pair["truncated"]
                pair["domain"] = pair["domain"] or source.domain or ""
                if images is not None:
                    pair["image_root"] = image_root(source.path)
                members[-1].append(len(self.pairs))
                self.pairs.append(pair)
        bar.close()
        skipped = {r: counts[r] for r in _REASONS if counts[r]}
        if not self.pairs or not all(members):
            empty = "" if self.pairs else " any"
            raise ValueError(
                f"no usable preference pair in{empty} source ({counts['read']} records read, "
                f"{counts['used']} kept, left out: {skipped}); first errors: {errors[:3]}"
            )
        if skipped:
            _log.warning(
                "left out %d of %d preference records: %s",
                sum(skipped.values()),
                counts["read"],
                skipped,
            )
        if domains is None:
            named = [s.domain for s in sources if s.domain is not None]
            domains = [*dict.fromkeys(named), *sorted({p["domain"] for p in self.pairs} - {*named})]
        self.domains = tuple(domains)
        index_of = {name: i for i, name in enumerate(self.domains)}
        per_domain = dict.fromkeys(self.domains, 0)
        for pair in self.pairs:
            if pair["domain"] not in index_of:
                raise ValueError(
                    f"record domain {pair['domain']!r} is not in domains={list(self.domains)}"
                )
            pair["domain_id"] = index_of[pair["domain"]]
            per_domain[pair["domain"]] += 1
        self.stats = {
            **counts,
            "skipped": sum(c["skipped"] for c in per_source),
            "domains": per_domain,
            "sources": dict(zip(self.source_names, per_source, strict=True)),
            "errors": errors,
        }
        self._paths = [s.path for s in sources]
        self._metrics = count_metrics(self.stats)
        self.log_stats("when encoding its pairs")
        self._reference: tuple[np.ndarray, np.ndarray] | None = None
        self._identity = canonical_identity(
            {
                "config": identity,
                "process": [process_index, process_count],
                "records": [len(s.records) for s in sources],
                "pairs": len(self.pairs),
            }
        )
        indices = index_mixture(
            members,
            [s.weight for s in sources],
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
        )
        self._dataset = indices.batch(rows, batch_fn=self._collate)
        self._iterator = self._dataset.__iter__()

    def _collate(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        batch = collate([self.pairs[i] for i in indices], self.max_len, self.rows, self.images)
        if self._reference is not None:
            for side, values in zip(SIDES, self._reference, strict=True):
                batch[f"ref_{side}_logps"] = np.zeros(self.rows, np.float32)
                batch[f"ref_{side}_logps"][: len(indices)] = values[list(indices)]
        return batch

    def __iter__(self) -> PreferenceData:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def batch_metrics(self) -> dict[str, float]:
        """`stats` as train metrics, which the loop logs with each step: data/truncated,
        data/dropped, data/skipped, data/no_loss, and the same per source, data/<source
        name>/truncated etc., once non-zero (`_accounting`); fixed from the start, since every
        pair is encoded up front."""
        return dict(self._metrics)

    def log_stats(self, when: str = "at the end of the run") -> None:
        """Logs one line per source that cut or left out records."""
        for path, name in zip(self._paths, self.source_names, strict=True):
            log_source(
                path,
                self.stats["sources"][name],
                max_len=self.max_len,
                when=when,
                skipped_as="malformed or with an empty or identical response",
            )

    def get_state(self) -> dict[str, Any]:
        """The iterator position (a JSON-serialisable dict) to save with a checkpoint."""
        return {"pipeline": self._identity, "iterator": self._iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes at a `get_state()` position: the batches that follow are the same as then.

        Raises:
          ValueError: the state was saved by a pipeline with other data, config or processes.
        """
        if canonical_identity(state.get("pipeline", {})) != self._identity:
            raise ValueError(
                "the preference data state was saved by a different pipeline (saved "
                f"{state.get('pipeline')}, now {self._identity}); resume with the same data "
                "config, process layout and data files, or start afresh"
            )
        self._iterator.set_state(state["iterator"])

    def set_reference(self, chosen: np.ndarray, rejected: np.ndarray) -> None:
        """Attaches precomputed reference log-probs (`[len(pairs)]` each, in pair order): every
        batch from now on carries `ref_chosen_logps` and `ref_rejected_logps`."""
        chosen, rejected = np.asarray(chosen, np.float32), np.asarray(rejected, np.float32)
        if chosen.shape != (len(self.pairs),) or rejected.shape != (len(self.pairs),):
            raise ValueError(
                f"reference log-probs must have shape ({len(self.pairs)},), got "
                f"{chosen.shape} and {rejected.shape}"
            )
        self._reference = (chosen, rejected)

    def ordered_batches(self, num_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Every kept pair once, in pair order, `rows` per batch (the last padded with filler
        rows): the pass that precomputes reference log-probs, and evaluation. `num_batches` pads
        the pass with empty batches up to that count."""
        n = len(self.pairs)
        count = -(-n // self.rows) if num_batches is None else num_batches
        if count * self.rows < n:
            raise ValueError(f"{count} batches of {self.rows} rows cannot hold {n} pairs")
        for b in range(count):
            yield self._collate(range(b * self.rows, min(n, (b + 1) * self.rows)))

    def fingerprint(self) -> str:
        """A hash of the pairs' tokens and masks (which reference log-probs belong to)."""
        h = hashlib.sha256()
        for pair in self.pairs:
            for side in SIDES:
                for name in ("tokens", "loss_mask"):
                    h.update(np.ascontiguousarray(pair[side][name]).tobytes())
        return h.hexdigest()


class _MemoryRecords:
    """A list of records (or a JSONL file's lines) as (raw record, location) pairs."""

    def __init__(self, records):
        if isinstance(records, str | Path):
            with open(records, encoding="utf-8") as f:
                records = [line for line in f if line.strip()]
        self._records = list(records)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> tuple[Any, str]:
        return self._records[i], f"record {i}"


def make_preference_pipeline(
    config: DataConfig,
    tokenizer: Tokenizer | str | Path,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    domains: Sequence[str] | None = None,
    vision: VisionConfig | None = None,
) -> PreferenceData:
    """This process's preference batches from the sources of a `DataConfig`.

    Each source is a file or glob of preference records (JSON lines, Parquet or ArrayRecord);
    a record's own "domain" wins over its source's `domain`. The config's `packing` must be
    False (one pair per row) and each source's `format` "auto".

    Args:
      config: sources, max_len, batch_size (global rows, split over processes), seed, shuffle,
        num_epochs, on_error, overlong, add_eos.
      tokenizer: a `Tokenizer`, or a directory to load one from.
      process_index, process_count: this process's shard; default `jax.process_index()` and
        `jax.process_count()`.
      domains: domain names in `domain_ids` order (default: the sources' domains, then any other
        record domain, sorted). Pass the training run's to an eval pipeline.
      vision: a vision-language model's vision config: pairs may then hold images, which
        batches carry as `images`.

    Raises:
      ValueError: packing requested, a source format other than "auto", batch_size not a
        multiple of process_count, a bad record with on_error="raise", or a source with no
        usable pair on this process.
      FileNotFoundError: a missing source.
    """
    if config.packing:
        raise ValueError(
            "data.packing=True is not supported for preference pairs (one pair per row); set "
            "data.packing=False"
        )
    if bad := [s.path for s in config.sources if s.format != "auto"]:
        raise ValueError(
            f"preference sources {bad} set a format; preference records are always "
            f"{EXPECTED}: leave format='auto'"
        )
    pi, pc, tokenizer = process_share(config, tokenizer, process_index, process_count)
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _RUNTIME_FIELDS}
    fields = without_new_defaults(fields)
    records = [Records.of(s) for s in config.sources]
    sources = [
        _Source(r, s.domain, s.weight, s.path) for s, r in zip(config.sources, records, strict=True)
    ]
    data = PreferenceData(
        sources,
        tokenizer,
        max_len=config.max_len,
        rows=config.batch_size // pc,
        seed=config.seed,
        shuffle=config.shuffle,
        num_epochs=config.num_epochs,
        on_error=config.on_error,
        overlong=config.overlong,
        add_eos=config.add_eos,
        domains=domains,
        process_index=pi,
        process_count=pc,
        identity=fields,
        images=vision_spec(config, tokenizer, vision),
    )
    data.manifest = functools.cache(lambda: data_manifest(config, tokenizer, records, pc))
    return data


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
    """Batches of preference pairs from records in memory (or one JSONL file), on one process.

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
      A `PreferenceData` iterator (see there for the arrays and `stats`).
    """
    path = str(records) if isinstance(records, str | Path) else "records"
    return PreferenceData(
        [_Source(_MemoryRecords(records), path=path)],
        tokenizer,
        max_len=max_len,
        rows=batch_size,
        seed=seed,
        shuffle=shuffle,
        num_epochs=num_epochs,
        on_error=on_error,
        overlong=overlong,
        add_eos=add_eos,
        domains=domains,
        identity={"records": "in memory", "max_len": max_len, "seed": seed, "shuffle": shuffle},
    )
