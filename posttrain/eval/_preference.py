"""Which response of a preference pair a model finds likelier (summed log-probs, no reference)."""

from __future__ import annotations

import jax
import numpy as np

from posttrain.data import preference_batches
from posttrain.train import reference_logps


def preference_wins(
    model, tokenizer, pairs, *, max_len: int = 64, batch_size: int = 64
) -> tuple[np.ndarray, dict]:
    """Per pair, whether the model's summed log-prob of `chosen` exceeds that of `rejected`.

    Args:
      model: a `Transformer`.
      tokenizer: its tokenizer.
      pairs: preference records `{"prompt", "chosen", "rejected"}` (or a JSONL path).
      max_len: tokens of prompt + response; longer pairs are truncated.
      batch_size: pairs per forward pass.

    Returns:
      (wins, stats): a boolean array over the pairs that could be encoded, in order, and the
      pipeline's counts (pairs skipped as malformed, empty or identical are counted there).
    """
    data = preference_batches(
        pairs, tokenizer, max_len=max_len, batch_size=batch_size, shuffle=False, num_epochs=1
    )
    score = jax.jit(reference_logps, static_argnums=1)
    wins = []
    for batch in data:
        n = int(np.sum(batch["chosen_segment_ids"].any(axis=1)))  # real pairs come first
        logps = score(model.params, model.config, batch)
        wins.extend(np.asarray(logps["ref_chosen_logps"] > logps["ref_rejected_logps"])[:n])
    return np.asarray(wins, bool), dict(data.stats)


def prefers_chosen(model, tokenizer, pairs, *, max_len: int = 64, batch_size: int = 64) -> float:
    """Share of pairs whose chosen response the model finds likelier than the rejected one
    (summed log-probs; no reference): ~50% for a model with no preference."""
    wins, _ = preference_wins(model, tokenizer, pairs, max_len=max_len, batch_size=batch_size)
    return float(np.mean(wins))
