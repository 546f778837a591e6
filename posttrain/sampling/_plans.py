"""The engine's device calls as a run makes them, for ahead-of-time compilation of a plan
(`posttrain compile`): abstract weights, rows and KV pool laid out as the engine lays them out
on the plan's mesh (`_paged.rows_shardings`), and inputs of the sizes the run feeds."""

from __future__ import annotations

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.sampling._paged import decode, empty_rows, prefill, rows_shardings
from posttrain.sampling._params import SamplingParams
from posttrain.sampling._prefill_inputs import prefill_inputs
from posttrain.sampling._request import Request


def _rows(model: Transformer, config, max_len: int, mesh, kernel: str):
    """(abstract rows and pool with their shardings, blocks per row)."""
    blocks_per_seq = -(-max_len // config.block_size)
    num_blocks = config.num_blocks or 1 + config.slots * blocks_per_seq
    shapes = jax.eval_shape(
        lambda: empty_rows(model.config, config, num_blocks, blocks_per_seq, combined=bool(kernel))
    )
    rows = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        rows_shardings(shapes, mesh),
    )
    return rows, blocks_per_seq


def _replicated(x, mesh) -> jax.ShapeDtypeStruct:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)


def planned_decode(model: Transformer, config, max_len: int, mesh, platform: str = "tpu"):
    """The engine's decode call: `(decode, args, static kwargs)` with `model`'s (abstract,
    sharded) weights, the rows and KV pool of `config` (an `EngineConfig` with its slots set)
    for rows of `max_len` tokens, and a chunk of decode steps attending over every block of a
    row."""
    kernel = config.kernel(model.config, platform, mesh.size)
    rows, blocks_per_seq = _rows(model, config, max_len, mesh, kernel)
    eos = _replicated(np.zeros(1, np.int32), mesh)
    static = dict(steps=config.chunk, blocks=blocks_per_seq, block_size=config.block_size,
                  kernel=kernel, unstack=config.unstack_layers)  # fmt: skip
    return decode, (model, rows, eos), static


def planned_prefill(
    model: Transformer, config, max_len: int, prompt_len: int, n: int, mesh, platform: str = "tpu"
):
    """The engine's prefill call of a first admission round: `(prefill, args, static
    kwargs)` that prefills `config.slots // n` prompts of `prompt_len` tokens, each once for
    its n samples (prefix sharing), and starts every row."""
    kernel = config.kernel(model.config, platform, mesh.size)
    rows, blocks_per_seq = _rows(model, config, max_len, mesh, kernel)
    groups, bs = config.slots // n, config.block_size
    used = -(-prompt_len // bs)
    leaders, starts = [], []
    for g in range(groups):
        req = Request([1] * prompt_len, max_len - prompt_len, np.zeros(2, np.uint32), n=n,
                      sampling=SamplingParams())  # fmt: skip
        table = list(range(1 + g * used, 1 + (g + 1) * used))
        leaders.append((req, table, 0, 0))
        starts += [(g * n + s, req, s, table, g) for s in range(n)]
    inputs = prefill_inputs(
        leaders, starts, [], [], slots=config.slots, block_size=bs, bucket=config.prefill_bucket,
        blocks_per_seq=blocks_per_seq, history=rows.history_BT.shape[1],
    )  # fmt: skip
    args = (model, None, rows, *(_replicated(x, mesh) for x in inputs))
    return prefill, args, {"block_size": bs}
