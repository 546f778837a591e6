"""Mixing sources: the Grain stream of item indices drawn from several sources by weight."""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np

from posttrain.data._curriculum import Phase, curriculum_dataset


def _seed(seed: int, *salt: int) -> int:
    return int(np.random.SeedSequence([seed, *salt]).generate_state(1)[0])


def index_mixture(
    members: list[list[int]],
    weights: list[float],
    *,
    seed: int,
    shuffle: bool,
    num_epochs: int | None,
    curriculum: tuple[Phase, ...] = (),
    names: Sequence[str] = (),
    rows: int = 1,
) -> grain.IterDataset:
    """A Grain stream of item indices from several sources (`members[i]`: source i's items).

    num_epochs=None repeats every source forever, each reshuffled per epoch with its own seed,
    mixed by `weights`, or picked by the `curriculum` phases (sources by `names`, phases in
    steps of `rows` items); n concatenates the sources, shuffles and makes n passes. Its
    iterator state is a small dict (the position), saved with checkpoints.
    """
    parts = [grain.MapDataset.source(m) for m in members]
    if num_epochs is None:
        if shuffle:
            parts = [p.shuffle(seed=_seed(seed, i)) for i, p in enumerate(parts)]
        parts = [p.repeat() for p in parts]
        if curriculum:
            ds = curriculum_dataset(parts, curriculum, names, rows=rows, process_count=1)
        else:
            ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    else:
        ds = parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)
        ds = (ds.shuffle(seed=_seed(seed)) if shuffle else ds).repeat(num_epochs)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0))


def _mean_tokens(encode, records, sample: int = 256) -> float:
    """Mean tokens per example (as packed: truncated to max_len) of up to `sample` records
    spread evenly over the source; records that become no example count as none."""
    picks = np.linspace(0, len(records) - 1, min(sample, len(records))).astype(int)
    lengths = [len(out["example"]["tokens"]) for out in (encode(records[int(i)]) for i in picks)
               if "example" in out]  # fmt: skip
    return float(np.mean(lengths)) if lengths else 1.0
