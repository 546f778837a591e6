"""The SFT data config (`DataConfig`) and the fields of it that decide which batches come out."""

from __future__ import annotations

import dataclasses

from posttrain.data._accounting import source_names
from posttrain.data._curriculum import Phase, check_curriculum
from posttrain.data._sources import SourceConfig

# Fields that do not change which batches come out (kept out of the state's identity check).
_RUNTIME_FIELDS = ("read_threads", "read_buffer")


def config_identity(config) -> dict:
    """A data config's fields that decide which batches come out (its state's identity): all
    but the read threads and buffer (and `split_by`, a source's `split` and `columns` at their
    defaults, which states saved before they existed do not name)."""
    fields = {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if k not in _RUNTIME_FIELDS and not (k == "split_by" and v == "records")
    }
    return without_new_defaults(fields)


def without_new_defaults(fields: dict) -> dict:
    """`fields` (a data config as a dict) less its sources' `split` and `columns` at their
    defaults, which states saved before they existed do not name."""
    sources = [
        {k: v for k, v in s.items() if not (k in ("split", "columns") and not v)}
        for s in fields["sources"]
    ]
    return {**fields, "sources": sources}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How to turn SFT sources into batches.

    Attributes:
      sources: the sources of the mixture.
      max_len: row length L of every batch array.
      batch_size: rows per step over all processes; each process yields
        batch_size // process_count of them.
      seed: seeds the per-epoch shuffles; same config and seed give the same batches.
      packing: first-fit pack several examples into each row; else one example per row.
      shuffle: shuffle records, differently each epoch.
      num_epochs: None repeats forever, mixing sources by weight (training); n reads every
        record of every source n times, weights unused (evaluation), then stops.
      on_error: "raise" on a malformed record (naming its file and line/row), or "skip" it and
        count it in `stats["skipped"]`.
      overlong: examples longer than max_len are cut to it ("truncate") or left out ("drop");
        both counted in `stats`.
      add_eos: append EOS to text and string completions (chat templates end turns themselves).
      read_threads: threads decoding and tokenizing records ahead of packing (no effect on the
        batches).
      read_buffer: records decoded ahead of packing (no effect on the batches).
      mix_by: what the sources' weights share out when repeating forever: "records" (a
        weight-0.2 source gives 20% of the examples) or "tokens" (20% of the tokens in the
        packed rows: each weight is divided by the source's mean tokens per example, measured
        on up to 256 of its records), so long examples keep a set share of training.
      curriculum: phases that replace the sources' weights (`_curriculum.Phase`: weights by
        source name, lasting a number of steps or examples), e.g. easy buckets first; each
        source's `data/<source>/used` count is then logged with every step.
      max_images: for a vision-language model, the image slots of each packed row (batches
        carry `images` `[rows, max_images, S, S, C]`); 0: as many as max_len holds
        (max_len // tokens_per_image). An example with more is cut before the first image it
        cannot hold, like overlong text.
      split_by: how several processes share the data: "records" (each reads a 1/P share of
        every source's records and packs its own rows: scales with the data, but the batches
        depend on the number of processes) or "rows" (each reads every record and packs the
        whole global batch, feeding its own rows of it: the batches of one process on any
        number; for small sets such as rejection sampling's).
    """

    sources: tuple[SourceConfig, ...]
    max_len: int
    batch_size: int
    seed: int = 0
    packing: bool = True
    shuffle: bool = True
    num_epochs: int | None = None
    on_error: str = "raise"
    overlong: str = "truncate"
    add_eos: bool = True
    read_threads: int = 4
    read_buffer: int = 64
    mix_by: str = "records"
    curriculum: tuple[Phase, ...] = ()
    max_images: int = 0
    split_by: str = "records"

    def __post_init__(self):
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "curriculum", tuple(self.curriculum))
        checks = [
            (self.sources, "sources must name at least one SourceConfig"),
            (all(isinstance(s, SourceConfig) for s in self.sources), "sources: SourceConfigs"),
            (self.max_len >= 2, f"max_len must be at least 2, got {self.max_len}"),
            (self.batch_size >= 1, f"batch_size must be positive, got {self.batch_size}"),
            (0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}"),
            (self.num_epochs is None or self.num_epochs >= 1, "num_epochs: None or >= 1"),
            (self.on_error in ("raise", "skip"), f"on_error={self.on_error!r}: raise or skip"),
            (self.overlong in ("truncate", "drop"), f"overlong={self.overlong!r}: truncate|drop"),
            (self.read_threads >= 0 and self.read_buffer >= 0, "read_threads/read_buffer >= 0"),
            (self.mix_by in ("records", "tokens"), f"mix_by={self.mix_by!r}: records or tokens"),
            (not (self.curriculum and self.mix_by == "tokens"), "curriculum mixes by records"),
            (self.max_images >= 0, f"max_images must be >= 0, got {self.max_images}"),
            (self.split_by in ("records", "rows"), f"split_by={self.split_by!r}: records|rows"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DataConfig: {message}")
        if self.curriculum:
            names = source_names([s.path for s in self.sources])
            check_curriculum(self.curriculum, names, self.packing)
