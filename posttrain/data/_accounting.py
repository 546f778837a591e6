"""Record accounting: what each data source cut or left out, as counts, metrics and log lines.

Every data stream (`SFTData`, `PreferenceData`) counts, per source and in total, the records it
read, used, cut or left out, and reports them three ways: in its `stats`, in the train metrics
(its `batch_metrics()`, which the loop logs with each step to metrics.jsonl) and in log lines
(one per source with a non-zero count: at the end of each pass over that source, and at the end
of a run). The SFT pipeline counts in `Tally`, a stage of its Grain graph whose counters are
part of the iterator state, so that they are checkpointed and a resumed run continues them.

Metric names, each a cumulative count of this process's records (in a multi-process run
metrics.jsonl holds process 0's):

  data/truncated          examples cut to max_len (overlong="truncate")
  data/dropped            examples left out as longer than max_len (overlong="drop")
  data/skipped            records left out as malformed (on_error="skip"); preference records
                          also with an empty response or identical responses
  data/no_loss            records left out with no token to train on
  data/<source>/<count>   the same four per source, present only once non-zero; <source> is
                          the name `source_names` gives it
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

import grain

_log = logging.getLogger(__name__)
# Counters in total and per source (a record counts once each time it is read).
COUNTERS = ("read", "used", "skipped", "truncated", "dropped", "no_loss")
_REPORTED = ("truncated", "dropped", "skipped", "no_loss")  # the metrics and log lines
_LEFT_OUT = ("dropped", "skipped", "no_loss")
_LOGGED_SKIPS = 10


def source_names(paths: Sequence[str]) -> list[str]:
    """Each source's name in metrics: its file's name without the suffix ("data/train.jsonl" ->
    "train"; a glob's wildcards removed, or its directory's name if nothing is left), other
    characters than letters, digits, "-", "_" and "." made "_". A name two sources share gets
    "_<i>" appended, i the source's position in the mixture."""
    names = [_name(p) for p in paths]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def _name(path: str) -> str:
    *dirs, file = PurePosixPath(path).parts or ("",)
    for part in (PurePosixPath(file).stem, *reversed(dirs)):
        name = re.sub(r"[^\w.-]+", "_", re.sub(r"\[.*?\]|[*?]", "", part)).strip("._-")
        if name:
            return name
    return "source"


def zero_counts() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


def metrics(stats: Mapping) -> dict[str, float]:
    """The `data/...` metrics (see the module docstring) of a stream's `stats`."""
    out = {f"data/{k}": float(stats[k]) for k in _REPORTED}
    for name, counts in stats["sources"].items():
        out.update({f"data/{name}/{k}": float(counts[k]) for k in _REPORTED if counts[k]})
    return out


def log_source(
    path: str,
    counts: Mapping[str, int],
    *,
    max_len: int,
    when: str,
    skipped_as: str = "malformed",
) -> None:
    """One line saying what source `path` cut or left out, e.g. "data source train.jsonl, after
    epoch 1: 12 of 400 records truncated to max_len=512, 1 skipped as malformed
    (on_error='skip')"; a warning when records were left out, nothing when all counts are 0."""
    parts = [
        (counts["truncated"], f"truncated to max_len={max_len}"),
        (counts["dropped"], f"dropped as longer than max_len={max_len} (overlong='drop')"),
        (counts["skipped"], f"skipped as {skipped_as} (on_error='skip')"),
        (counts["no_loss"], "left out with no token to train on"),
    ]
    parts = [(n, text) for n, text in parts if n]
    if not parts:
        return
    (first, text), *rest = parts
    said = [f"{first} of {counts['read']} records {text}", *(f"{n} {t}" for n, t in rest)]
    level = logging.WARNING if any(counts[k] for k in _LEFT_OUT) else logging.INFO
    _log.log(level, "data source %s, %s: %s", path, when, ", ".join(said))


class Tally(grain.IterDataset):
    """Passes examples on, leaving out records that gave none, and counts every record in total
    and per source; logs a source's counts each time all its records have been read."""

    def __init__(self, parent: grain.IterDataset, *, paths, sizes, domains, max_len):
        super().__init__(parent)
        self.paths, self.sizes, self.domains, self.max_len = paths, sizes, domains, max_len

    def __iter__(self) -> TallyIterator:
        self.live = TallyIterator(self._parent.__iter__(), self)
        return self.live


class TallyIterator(grain.DatasetIterator):
    """The counters live in the iterator state, so they are checkpointed with the data."""

    def __init__(self, parent: grain.DatasetIterator, spec: Tally):
        super().__init__(parent)
        self._spec = spec
        self._last_error = None
        self.set_tally(
            {
                "counts": zero_counts(),
                "domains": [0] * len(spec.domains),
                "streak": [0] * len(spec.sizes),
            }
        )

    def tally(self) -> dict[str, Any]:
        return {
            "counts": dict(self._counts),
            "domains": list(self._domains),
            "streak": list(self._streak),
            "sources": [dict(c) for c in self._sources],
        }

    def set_tally(self, tally: dict[str, Any]):
        self._counts, self._domains = dict(tally["counts"]), list(tally["domains"])
        # Records in a row of each source that gave no example: a full pass means none can.
        self._streak = list(tally["streak"])
        # (A state saved before per-source counts existed resumes them from 0.)
        sources = tally.get("sources") or [zero_counts() for _ in self._spec.sizes]
        self._sources = [dict(c) for c in sources]

    def __next__(self) -> dict[str, Any]:
        counts = self._counts
        while True:
            try:
                item = next(self._parent)
            except StopIteration:
                if counts["used"] == 0:
                    raise ValueError(self._empty_message("the data")) from None
                raise
            source, example = item["source"], item.get("example")
            status = "used" if example is not None else item["status"]
            for c in (counts, self._sources[source]):
                c["read"] += 1
                c["truncated"] += item.get("truncated", False)
                c[status] += 1
            self._end_of_pass(source)
            if example is not None:
                self._domains[int(example["domain_ids"][0])] += 1
                self._streak[source] = 0
                return example
            if "error" in item:
                self._last_error = item["error"]
                if counts["skipped"] <= _LOGGED_SKIPS:
                    _log.warning("skipped malformed record: %s", item["error"])
            self._streak[source] += 1
            if self._streak[source] >= 2 * self._spec.sizes[source]:
                raise ValueError(self._empty_message(f"data source {self._spec.paths[source]}"))

    def _end_of_pass(self, source: int):
        """Logs the source's counts if this record was the last of a pass over it (an epoch)."""
        read, size = self._sources[source]["read"], self._spec.sizes[source]
        if read % size == 0:
            path, counts = self._spec.paths[source], self._sources[source]
            when = f"after epoch {read // size}"
            log_source(path, counts, max_len=self._spec.max_len, when=when)

    def _empty_message(self, what: str) -> str:
        last = f" Last skipped: {self._last_error}" if self._last_error else ""
        return (
            f"{what} yields no example: every record read was skipped as malformed "
            "(on_error='skip'), dropped as longer than max_len (overlong='drop'), or has no "
            f"token to train on. Counts so far: {self._counts}.{last}"
        )

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "tally": json.loads(json.dumps(self.tally()))}

    def set_state(self, state: dict[str, Any]):
        self._parent.set_state(state["parent"])
        self.set_tally(state["tally"])


def find_tally(state: Any) -> dict[str, Any] | None:
    """The tally inside a (nested) iterator state."""
    if isinstance(state, dict):
        if "tally" in state:
            return state["tally"]
        for value in state.values():
            if (found := find_tally(value)) is not None:
                return found
    elif isinstance(state, list | tuple):
        for value in state:
            if (found := find_tally(value)) is not None:
                return found
    return None
