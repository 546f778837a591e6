"""Prompt difficulty from sampled rewards: pass rates, pass@k and filtering (bucketing by
difficulty: `posttrain.curate.stratify`).

Scores come grouped by prompt: a mapping {prompt key: [score of each of k samples]} or a list of
such lists (keyed by position). A sample passes when its score is at least `threshold`.
`filter_by_pass_rate` is DAPO's dynamic-sampling filter: a prompt whose samples all pass or all
fail has zero reward variance, so a group-relative advantage gives it no gradient.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

Scores = Mapping[Hashable, Sequence[float]] | Sequence[Sequence[float]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c pass (Chen et al., 2021).

    1 - C(n-c, k) / C(n, k), computed as a stable product.

    Args:
      n: samples drawn.
      c: samples that passed.
      k: the k of pass@k, 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def pass_rate(scores_by_prompt: Scores, *, threshold: float = 0.5) -> dict[Hashable, float]:
    """Each prompt's fraction of passing samples.

    Args:
      scores_by_prompt: {key: scores} or [scores] (keys are then positions).
      threshold: a sample passes when its score is >= threshold.

    Returns:
      {key: pass rate in [0, 1]}, in input order.
    """
    rates = {}
    for key, scores in _items(scores_by_prompt):
        if len(scores) == 0:
            raise ValueError(f"prompt {key!r} has no scored samples")
        rates[key] = float(np.mean(np.asarray(scores, np.float64) >= threshold))
    return rates


def filter_by_pass_rate(
    scores_by_prompt: Scores,
    *,
    threshold: float = 0.5,
    min_rate: float = 0.0,
    max_rate: float = 1.0,
) -> list[Hashable]:
    """The prompts whose pass rate lies strictly between `min_rate` and `max_rate`.

    With the defaults this drops the all-fail and all-pass prompts (DAPO dynamic sampling).

    Args:
      scores_by_prompt: {key: scores} or [scores].
      threshold: a sample passes when its score is >= threshold.
      min_rate: prompts at or below this pass rate are dropped.
      max_rate: prompts at or above this pass rate are dropped.

    Returns:
      The kept keys (positions for a list), in input order.
    """
    rates = pass_rate(scores_by_prompt, threshold=threshold)
    return [key for key, rate in rates.items() if min_rate < rate < max_rate]


def _items(scores_by_prompt: Scores):
    if isinstance(scores_by_prompt, Mapping):
        return scores_by_prompt.items()
    return enumerate(scores_by_prompt)
