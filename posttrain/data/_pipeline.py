"""The SFT input pipeline: sources -> mixture -> tokenized examples -> packed rows -> batches.

A Grain graph, so that its iterator state is a checkpointable dict and resume is exact:

    per source: MapDataset.source(records).map(encode)[process_index::process_count]
                .shuffle(seed_i).repeat()          # reshuffled every epoch
    MapDataset.mix(sources, weights)               # num_epochs=None: weighted, forever
      or concatenate(sources).shuffle().repeat(n)  # num_epochs=n: every record n times
    .to_iter_dataset()                             # decoding and tokenizing in threads
    Tally                                          # filters skipped/dropped records, counts
    FirstFitPackIterDataset                        # rows of max_len, segment ids, positions
    .batch(rows)                                   # rows = batch_size // process_count
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np

from posttrain.data._accounting import Tally, find_tally, log_source, source_names
from posttrain.data._accounting import metrics as count_metrics
from posttrain.data._curriculum import curriculum_dataset
from posttrain.data._data_config import DataConfig, config_identity
from posttrain.data._formats import ExampleEncoder
from posttrain.data._image_chat import image_root, vision_spec
from posttrain.data._manifest import data_manifest
from posttrain.data._mixing import _mean_tokens, _seed
from posttrain.data._sources import Records, canonical_identity
from posttrain.data._tokenizer import Tokenizer, load_tokenizer
from posttrain.models import VisionConfig


def process_share(
    config: DataConfig, tokenizer, process_index: int | None, process_count: int | None
) -> tuple[int, int, Tokenizer]:
    """(process_index, process_count, Tokenizer) of a pipeline, checked: the index is in range
    and the global batch divides over the processes."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    if not 0 <= pi < pc:
        raise ValueError(f"process_index {pi} is not in [0, process_count={pc})")
    if config.batch_size % pc:
        raise ValueError(
            f"batch_size {config.batch_size} does not divide over {pc} processes; "
            f"use a multiple of {pc}"
        )
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    return pi, pc, tokenizer


def make_pipeline(
    config: DataConfig,
    tokenizer: Tokenizer | str | Path,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    vision: VisionConfig | None = None,
) -> SFTData:
    """Builds this process's SFT batch stream.

    Args:
      config: the data configuration.
      tokenizer: a `Tokenizer`, or a directory to load one from.
      process_index, process_count: this process's shard; default `jax.process_index()` and
        `jax.process_count()`.
      vision: a vision-language model's vision config: records may then hold images
        (`posttrain.data._image_chat`), and batches carry their pixels.

    Returns:
      The `SFTData` iterator.

    Raises:
      FileNotFoundError: a source path is missing or its glob matches nothing.
      ValueError: a source holds no records (or fewer than process_count), batch_size is not a
        multiple of process_count, or EOS is needed but the tokenizer has none.
    """
    pi, pc, tokenizer = process_share(config, tokenizer, process_index, process_count)
    if (
        config.add_eos
        and tokenizer.eos_id is None
        and any(s.format != "messages" for s in config.sources)
    ):
        raise ValueError(
            f"add_eos=True but {tokenizer.name_or_path} has no eos_token; set one in "
            "tokenizer_config.json or set add_eos=False"
        )
    images = vision_spec(config, tokenizer, vision)
    records = [Records.of(s) for s in config.sources]
    for source, recs in zip(config.sources, records, strict=True):
        if len(recs) < pc and config.split_by == "records":
            raise ValueError(
                f"data source {source.path} has {len(recs)} records, fewer than the "
                f"{pc} processes that each read a share"
            )
        if config.on_error == "raise":  # a file in the wrong format fails now, not mid-run
            ExampleEncoder(
                tokenizer, source.format, config.max_len, source=0, domain=0,
                add_eos=config.add_eos, on_error="raise", overlong="truncate",
                images=images, image_root=image_root(source.path),
            )(recs[0])  # fmt: skip
    return SFTData(config, tokenizer, records, pi, pc, images)


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    row = {
        "tokens": packed["tokens"],
        "targets": packed["targets"],
        "loss_mask": packed["loss_mask"],
        "positions": packed["tokens_positions"],
        "segment_ids": packed["tokens_segment_ids"],
        "domain_ids": packed["domain_ids"],
    }
    if "images" in packed:  # a VLM's row: its examples' images in order, zeros after them
        row["images"] = packed["images"]
    return row


def _fill_rows(batch: dict[str, np.ndarray], *, rows: int, pad: dict[str, Any]):
    """Pads the last, short batch of a finite stream with empty rows (shapes stay fixed)."""
    n = len(batch["tokens"])
    if n == rows:
        return batch
    return {
        k: np.concatenate([v, np.full((rows - n, *v.shape[1:]), pad.get(k, 0), v.dtype)])
        for k, v in batch.items()
    }


class SFTData:
    """This process's stream of SFT batches; build it with `make_pipeline`.

    Iterating yields dicts of numpy arrays, each `[rows, max_len]` with rows =
    batch_size // process_count:

      tokens      int32    input ids; pad_id (0 if none) in padding
      targets     int32    the next token of the same document; 0 where there is none
      loss_mask   float32  1.0 where targets is trained on; 0 at padding and at each
                           document's last token (no target crosses documents)
      positions   int32    position inside the document, from 0 for each packed document
      segment_ids int32    1, 2, ... per document in the row; 0 in padding
      domain_ids  int32    index into `domains` of the token's source domain; -1 in padding
      images      float32  (a VLM's, `[rows, max_images, S, S, C]`) the row's images in the
                           order of its image tokens, zeros in unused slots

    With num_epochs set, the stream ends after the last example (its last batch padded with
    empty rows); processes may then yield different numbers of batches.

    Attributes:
      config, tokenizer, process_index, process_count: as given to `make_pipeline`.
      domains: domain names, in order of first appearance in `config.sources`.
      source_names: each source's name in `stats["sources"]` and in metrics (its file's name
        without the suffix; `posttrain.data._source_names`).
      rows: rows per batch on this process.
    """

    def __init__(self, config, tokenizer, records, process_index, process_count, images=None):
        self.config, self.tokenizer, self._records = config, tokenizer, records
        self.images = images
        self.process_index, self.process_count = process_index, process_count
        self.domains = tuple(dict.fromkeys(s.domain for s in config.sources))
        self.source_names = tuple(source_names([s.path for s in config.sources]))
        self.rows = config.batch_size // process_count
        self._manifest, self._exhausted = None, False
        fields = config_identity(config)
        self._identity = canonical_identity(
            {
                "config": fields,
                "process": [process_index, process_count],
                "records": [len(r) for r in records],
            }
        )
        self._iterator = self._dataset().__iter__()

    def _dataset(self) -> grain.IterDataset:
        c, pi, pc, rows = self.config, self.process_index, self.process_count, self.rows
        if c.split_by == "rows":  # every process packs the global batch (then takes its rows)
            pi, pc, rows = 0, 1, c.batch_size
        encoders = [
            ExampleEncoder(
                self.tokenizer,
                s.format,
                c.max_len,
                source=i,
                domain=self.domains.index(s.domain),
                add_eos=c.add_eos,
                on_error=c.on_error,
                overlong=c.overlong,
                images=self.images,
                image_root=image_root(s.path),
            )
            for i, s in enumerate(c.sources)
        ]
        parts = [
            grain.MapDataset.source(recs).map(encode).slice(slice(pi, None, pc))
            for encode, recs in zip(encoders, self._records, strict=True)
        ]
        if c.num_epochs is None:
            parts = [
                p.shuffle(seed=_seed(c.seed, i)) if c.shuffle else p for i, p in enumerate(parts)
            ]
            parts = [p.repeat() for p in parts]
            weights = [s.weight for s in c.sources]
            if c.mix_by == "tokens":
                weights = [w / _mean_tokens(e, r) for w, e, r in
                           zip(weights, encoders, self._records, strict=True)]  # fmt: skip
            if c.curriculum:
                ds = curriculum_dataset(
                    parts, c.curriculum, self.source_names, rows=rows, process_count=pc
                )
            else:
                ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
        else:
            ds = parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)
            ds = (ds.shuffle(seed=_seed(c.seed)) if c.shuffle else ds).repeat(c.num_epochs)
        options = grain.ReadOptions(num_threads=c.read_threads, prefetch_buffer_size=c.read_buffer)
        self._tally = tally = Tally(
            ds.to_iter_dataset(options),
            paths=[s.path for s in c.sources],
            sizes=[len(range(pi, len(r), pc)) for r in self._records],
            domains=self.domains,
            max_len=c.max_len,
        )
        pad_id = self.tokenizer.pad_id or 0
        length = dict.fromkeys(("tokens", "targets", "loss_mask", "domain_ids"), c.max_len)
        padding = {"tokens": pad_id, "targets": 0, "loss_mask": 0.0, "domain_ids": -1}
        if self.images is not None:  # an example goes into a row only if its images fit too
            length["images"], padding["images"] = self.images.max_images, 0.0
        packed = grain.experimental.FirstFitPackIterDataset(
            tally,
            length_struct=length,
            num_packing_bins=rows,
            shuffle_bins=False,
            padding_struct=padding,
            max_sequences_per_bin=None if c.packing else 1,
        )
        pad = {"tokens": pad_id, "domain_ids": -1}
        batches = packed.map(_row).batch(rows).map(lambda b: _fill_rows(b, rows=rows, pad=pad))
        if rows != self.rows:  # (split_by="rows": this process's rows of the global batch)
            mine = slice(self.process_index * self.rows, (self.process_index + 1) * self.rows)
            batches = batches.map(lambda b: {k: v[mine] for k, v in b.items()})
        return batches

    def __iter__(self) -> SFTData:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        try:
            return next(self._iterator)
        except StopIteration:
            self._exhausted = True
            raise

    def get_state(self) -> dict[str, Any]:
        """The iterator position (a JSON-serialisable dict) to save with a checkpoint."""
        return {"pipeline": self._identity, "iterator": self._iterator.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes at a `get_state()` position; the batches that follow are the same as then.

        Raises:
          ValueError: the state was saved by a pipeline with another config, shard or data.
        """
        saved = canonical_identity(state.get("pipeline", {}))
        if saved != self._identity:
            diff = sorted(
                k
                for k in {*saved.get("config", {}), *self._identity["config"]}
                if saved.get("config", {}).get(k) != self._identity["config"].get(k)
            )
            diff += [k for k in ("process", "records") if saved.get(k) != self._identity[k]]
            raise ValueError(
                f"the data state was saved by a different pipeline (differs in {diff}); resume "
                "with the same data config, process layout and data files, or start afresh"
            )
        self._iterator.set_state(state["iterator"])
        self._exhausted = False

    @property
    def stats(self) -> dict[str, Any]:
        """This process's counters over the records behind the batches yielded so far.

        Keys: read (records read), used (examples in batches), skipped (malformed), truncated,
        dropped (overlong), no_loss (no trained token, e.g. no assistant turn, or truncation cut
        every one), domains ({name: examples used}) and sources ({source name: the same six
        counts of its records}). A record counts each time it is read (once per epoch). They are
        part of `get_state()`, so they resume with it.
        """
        if self._exhausted:  # the state leaves out records read after the last example
            tally = self._tally.live.tally()
        else:
            tally = find_tally(self._iterator.get_state())
        return {
            **tally["counts"],
            "domains": dict(zip(self.domains, tally["domains"], strict=True)),
            "sources": {
                n: dict(c) for n, c in zip(self.source_names, tally["sources"], strict=True)
            },
        }

    def batch_metrics(self) -> dict[str, float]:
        """`stats` as train metrics, which the loop logs with each step: data/truncated,
        data/dropped, data/skipped and data/no_loss (this process's counts so far), and the same
        per source, data/<source name>/truncated etc., once non-zero (`_accounting`); with a
        curriculum also data/<source name>/used, the examples of each source so far."""
        stats = self.stats
        used = {f"data/{n}/used": float(s["used"]) for n, s in stats["sources"].items()}
        return {**count_metrics(stats), **(used if self.config.curriculum else {})}

    def log_stats(self, when: str = "at the end of the run") -> None:
        """Logs one line per source that cut or left out records (as each epoch's end does)."""
        counts = self.stats["sources"]
        for source, name in zip(self.config.sources, self.source_names, strict=True):
            log_source(source.path, counts[name], max_len=self.config.max_len, when=when)

    def manifest(self) -> dict[str, Any]:
        """What the batches are made of: the files (with sha256 and record counts), the config and
        the tokenizer's identity. JSON-serialisable; hashing reads every data file once."""
        if self._manifest is None:
            self._manifest = data_manifest(
                self.config, self.tokenizer, self._records, self.process_count
            )
        return self._manifest

    def write_manifest(self, path: str | Path) -> Path:
        """Writes `manifest()` as JSON to `path` (parents created) and returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.manifest(), indent=2) + "\n")
        return path

    def close(self) -> None:
        """Stops the reader threads."""
        self._iterator.close()
