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
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.sampling import Completion


def prompt_share(prompts: int) -> slice:
    """This process's contiguous share of a step's `prompts` (whole groups; the last
    processes' shares may be shorter or empty)."""
    per = -(-prompts // jax.process_count())
    start = min(prompts, per * jax.process_index())
    return slice(start, min(prompts, start + per))


def gather_groups(
    completions, rewards: np.ndarray, prompts: int, G: int, max_new_tokens: int, mesh
):
    """Every process's `(completions per prompt, rewards [share, G])`, concatenated in prompt
    order: `(completions, rewards [prompts, G])` on every process. The gathered completions
    carry ids, log-probs and finish reasons, not text (scoring has used it). The exchange runs
    on `mesh` (the sampler's devices, stacked by `process_meshes`), so a decoupled sampler's
    thread never queues a collective on the devices the trainer's steps use."""
    per = -(-prompts // jax.process_count())
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
    every = _allgather({**local, "scores": scores}, mesh)
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


def _allgather(tree, stacked_mesh):
    """Each process's arrays, concatenated in process order, on every process."""
    by_process = NamedSharding(stacked_mesh, PartitionSpec("processes"))
    n = jax.process_count()
    placed = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(
            by_process, x, (x.shape[0] * n, *x.shape[1:])
        ),
        tree,
    )
    return jax.tree.map(host_array, placed)


def host_array(x: jax.Array) -> np.ndarray:
    """The whole value of a (batch-sharded) global array on every process, gathered on the
    devices that hold it."""
    if jax.process_count() == 1:
        return np.asarray(x)
    everywhere = NamedSharding(x.sharding.mesh, PartitionSpec())
    return np.asarray(jax.jit(_identity, out_shardings=everywhere)(x).addressable_data(0))


def _identity(x):
    return x
