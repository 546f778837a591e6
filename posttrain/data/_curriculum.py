"""Curriculum mixtures: the sources' shares change by phase (e.g. difficulty buckets written by
`posttrain data stratify`: easy first, then a harder mix).

A phase lasts a number of steps (one example per row: `packing=False`) or of examples, and
gives each source a weight (0 leaves it out of the phase); the last phase may give neither and
lasts the rest of the run. The selection is a fixed function of the example index, so the
iterator state stays a position and resume is exact: within a phase, integer proportions
p_s (sum P) repeat a pattern of P picks that spreads each source evenly, and each source's
records continue where the previous phase left them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence

import grain
import numpy as np

_RESOLUTION = 1000  # weights are rounded to shares of 1/1000 of a phase


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a curriculum.

    Attributes:
      weights: {source name: weight}, a source's name being its file's name without the suffix
        (as in the `data/<source>/...` metrics); sources not named get 0.
      steps: how many optimizer steps the phase lasts (needs `packing=False`: a row per example).
      examples: or how many examples (rows' documents) it lasts; with neither, the rest of the
        run (the last phase only).
    """

    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    steps: int = 0
    examples: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.examples < 0 or (self.steps and self.examples):
            raise ValueError(
                f"curriculum phase {self}: give steps or examples (>= 1), not both; neither "
                "makes it last the rest of the run"
            )
        if not self.weights or any(not w >= 0 for w in self.weights.values()):
            raise ValueError(f"curriculum phase {self}: weights must be >= 0, some > 0")
        if not sum(self.weights.values()) > 0:
            raise ValueError(f"curriculum phase {self}: at least one weight must be > 0")


def check_curriculum(phases: Sequence[Phase], names: Sequence[str], packing: bool) -> None:
    """Raises ValueError saying what to change when `phases` do not fit the sources `names`."""
    for i, phase in enumerate(phases):
        if unknown := sorted(set(phase.weights) - set(names)):
            raise ValueError(
                f"curriculum phase {i} weighs unknown source(s) {unknown}; the sources are "
                f"{list(names)} (file names without suffix)"
            )
        if phase.steps and packing:
            raise ValueError(
                f"curriculum phase {i} lasts {phase.steps} steps, which needs one example per "
                "row: set data.packing=False, or give the phase `examples` instead"
            )
        last = i == len(phases) - 1
        if not last and not (phase.steps or phase.examples):
            raise ValueError(f"curriculum phase {i}: only the last phase may omit steps/examples")


def proportions(weights: Sequence[float]) -> list[int]:
    """Integer proportions of `weights` at 1/1000 resolution (largest remainder), reduced by
    their gcd; a positive weight keeps at least 1."""
    w = np.asarray(weights, np.float64)
    share = w / w.sum() * _RESOLUTION
    p = np.floor(share).astype(np.int64)
    p[(w > 0) & (p == 0)] = 1
    for i in np.argsort(-(share - np.floor(share)), kind="stable")[: max(_RESOLUTION - p.sum(), 0)]:
        p[i] += 1
    g = math.gcd(*p.tolist())
    return (p // g).tolist()


def _pattern(p: Sequence[int]) -> np.ndarray:
    """The sources of one period of picks: source s at the times (k + 1/2) / p_s, k < p_s, in
    time order (ties by source), so each source is spread evenly through the period."""
    times = [((k + 0.5) / ps, s) for s, ps in enumerate(p) for k in range(ps)]
    return np.asarray([s for _, s in sorted(times)], np.int64)


class CurriculumMap(grain.transforms.DatasetSelectionMap):
    """Example index -> (source, index in that source's endless stream), phase by phase.

    Args:
      lengths: each phase's number of examples on this process (None: the rest, last only).
      weights: each phase's weight per source, in source order.
    """

    def __init__(self, lengths: Sequence[int | None], weights: Sequence[Sequence[float]]):
        self._starts, self._phases = [], []
        start, offsets = 0, np.zeros(len(weights[0]), np.int64)
        for n, w in zip(lengths, weights, strict=True):
            p = np.asarray(proportions(w), np.int64)
            pattern = _pattern(p)
            ranks = np.zeros(len(pattern), np.int64)  # the pick's rank among its source's picks
            for s in range(len(p)):
                ranks[pattern == s] = np.arange(p[s])
            self._starts.append(start)
            self._phases.append((p, pattern, ranks, offsets.copy()))
            if n is None:
                break
            offsets += self._count(p, pattern, n)
            start += n

    @staticmethod
    def _count(p, pattern, n: int) -> np.ndarray:
        """How many of the first n picks of a phase come from each source."""
        whole, part = divmod(n, len(pattern))
        return whole * p + np.bincount(pattern[:part], minlength=len(p))

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> tuple[int, int]:
        phase = bisect.bisect_right(self._starts, index) - 1
        p, pattern, ranks, offsets = self._phases[phase]
        period, at = divmod(index - self._starts[phase], len(pattern))
        s = int(pattern[at])
        return s, int(offsets[s] + period * p[s] + ranks[at])


def curriculum_dataset(
    parts: Sequence[grain.MapDataset],
    phases: Sequence[Phase],
    names: Sequence[str],
    *,
    rows: int,
    process_count: int,
) -> grain.MapDataset:
    """The endless `parts` (one per source, repeated) picked by the curriculum `phases` on one
    process: `rows` examples per step on it (phases in steps), a `process_count`-th of each
    phase's examples (phases in examples)."""
    lengths = [
        ph.steps * rows if ph.steps else -(-ph.examples // process_count) if ph.examples else None
        for ph in phases
    ]
    if lengths[-1] is not None:
        lengths.append(None)  # after the last phase, its mix goes on
        phases = [*phases, phases[-1]]
    weights = [[_weight(ph.weights, n) for n in names] for ph in phases]
    return grain.MapDataset.select_from_datasets(list(parts), CurriculumMap(lengths, weights))


def _weight(weights: Mapping[str, float], name: str) -> float:
    return float(weights.get(name, 0.0))
