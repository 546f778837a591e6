"""RL across processes: every process draws the same prompts, samples and scores its share of
them on its own devices, and gets everyone's completions and rewards back in prompt order.

So every process holds the whole step's rollouts, builds the same global batch and host
metrics as one process would, and feeds its own rows of it (`process_rows`). Only token ids,
log-probs and rewards cross hosts (a few KB a step); the weights each process samples with are
its own copy (`to_process_local`).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from posttrain.sampling import Completion


def prompt_share(prompts: int) -> slice:
    """This process's contiguous share of a step's `prompts` (whole groups; the last
    processes' shares may be shorter or empty)."""
    per = -(-prompts // jax.process_count())
    start = min(prompts, per * jax.process_index())
    return slice(start, min(prompts, start + per))


def gather_groups(completions, rewards: np.ndarray, prompts: int, max_new_tokens: int):
    """Every process's `(completions per prompt, rewards [share, G])`, concatenated in prompt
    order: `(completions, rewards [prompts, G])` on every process. The gathered completions
    carry ids, log-probs and finish reasons, not text (scoring has used it)."""
    per = -(-prompts // jax.process_count())
    G = rewards.shape[1] if len(completions) else 0
    G = int(multihost_utils.process_allgather(np.asarray(G)).max())
    ids = np.zeros((per, G, max_new_tokens), np.int32)
    logps = np.zeros((per, G, max_new_tokens), np.float32)
    lengths = np.zeros((per, G), np.int32)
    truncated = np.zeros((per, G), bool)
    scores = np.zeros((per, G), np.float32)
    for i, group in enumerate(completions):
        for j, c in enumerate(group):
            n = len(c.token_ids)
            ids[i, j, :n], logps[i, j, :n], lengths[i, j] = c.token_ids, c.logprobs, n
            truncated[i, j] = c.finish_reason == "length"
        scores[i] = rewards[i]
    local = {"ids": ids, "logps": logps, "lengths": lengths, "truncated": truncated}
    every = multihost_utils.process_allgather({**local, "scores": scores}, tiled=True)
    out = []
    for i in range(prompts):  # (the tiled gather is in process order: prompt order)
        group = []
        for j in range(G):
            n = int(every["lengths"][i, j])
            group.append(
                Completion(
                    None,
                    tuple(int(t) for t in every["ids"][i, j, :n]),
                    tuple(float(x) for x in every["logps"][i, j, :n]),
                    "length" if every["truncated"][i, j] else "stop",
                )
            )
        out.append(group)
    return out, every["scores"][:prompts]


def host_array(x: jax.Array) -> np.ndarray:
    """The whole value of a (batch-sharded) global array on every process."""
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
