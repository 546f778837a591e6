"""An admission round as the host arrays of the engine's one prefill call (`_paged.prefill`).

A round is what `Engine._admit` decided: `leaders`, the prompts to pass, each
`(request, block table, first position passed, first position written)`; `starts`, the rows
to start, each `(row, request, sample, block table, leader index)`; `copies` and `pre`, block
copies after and before the forward. Prompt counts and lengths are rounded up (powers of two,
the prefill bucket) and rows and copies padded to `slots`, so rounds share compilations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.sampling._paged import SCRATCH
from posttrain.sampling._request import Request


def prefill_inputs(leaders, starts, copies, pre, *, slots: int, block_size: int,
                   bucket: int, blocks_per_seq: int, history: int) -> tuple:  # fmt: skip
    """`prefill`'s arguments after the model, the drafter and the rows, up to the images:
    `history` is the rows' token-history width (1: none kept)."""
    G = 1 << (len(leaders) - 1).bit_length()
    P = bucket * -(-max(len(r.prompt) - start for r, _, start, _ in leaders) // bucket)
    longest = max(len(r.prompt) for r, *_ in leaders)
    R = -(-(bucket * -(-longest // bucket)) // block_size)  # blocks covering every prompt
    tokens = np.zeros((G, P), np.int32)
    lengths = np.ones(G, np.int32)
    offsets = np.zeros(G, np.int32)
    write_from = np.zeros(G, np.int32)
    tables = np.zeros((G, R), np.int32)
    histories = np.zeros((G, history), np.int32)
    for g, (req, table, start, first_write) in enumerate(leaders):
        tokens[g, : len(req.prompt) - start] = req.prompt[start:]
        lengths[g], offsets[g], write_from[g] = len(req.prompt), start, first_write
        head = table[:R]
        tables[g, : len(head)] = head
        if history > 1:
            head = req.prompt[:history]
            histories[g, : len(head)] = head
    # A layered pool's ring row of each prompt: its first sample's row (padding: scratch).
    ring_rows = np.full(G, slots, np.int32)
    for row, _, _, _, group in reversed(starts):
        ring_rows[group] = row
    padded = starts + starts[-1:] * (slots - len(starts))
    row_tables = np.zeros((slots, blocks_per_seq), np.int32)
    for x, (_, _, _, table, _) in enumerate(padded):
        row_tables[x, : len(table)] = table

    def pairs(moves):
        moves = moves or [(SCRATCH, SCRATCH)]
        moves = moves + moves[-1:] * (slots - len(moves))
        return np.asarray([a for a, _ in moves], np.int32), np.asarray(
            [b for _, b in moves], np.int32
        )

    requests = [s[1] for s in padded]
    return (
        tokens, lengths, offsets, write_from, tables, ring_rows, histories, *pairs(pre),
        *pairs(copies), np.asarray([s[0] for s in padded], np.int32),
        np.asarray([s[4] for s in padded], np.int32), row_tables,
        np.asarray([r.max_new_tokens for r in requests], np.int32),
        _key_data([r.key for r in requests]), np.asarray([s[2] for s in padded], np.int32),
        np.asarray([r.sampling.temperature for r in requests], np.float32),
        np.asarray([r.sampling.top_k for r in requests], np.int32),
        np.asarray([r.sampling.top_p for r in requests], np.float32),
    )  # fmt: skip


def prefill_images(model_config, drafter, requests: list[Request], groups: int):
    """A VLM's prefill images `[groups, I, H, W, C]` (I: the most any prompt has, rounded up
    to a power of two to bound compilations; zeros past a prompt's own); None for a text
    model or prompts without images (their image tokens stay tokens)."""
    vision = model_config.vision
    if vision is None:
        if any(r.images is not None and len(r.images) for r in requests):
            raise ValueError(f"model {model_config.name!r} takes no images")
        return None
    if drafter is not None and any(r.images is not None for r in requests):
        raise ValueError("speculative decoding does not take images yet; drop the drafter")
    if all(r.images is None for r in requests):  # text only: image tokens stay tokens
        return None
    most = max([1, *(len(r.images) for r in requests if r.images is not None)])
    side = vision.image_size
    out = np.zeros((groups, 1 << (most - 1).bit_length(), side, side, vision.channels),
                   np.float32)  # fmt: skip
    for g, req in enumerate(requests):
        if req.images is not None and len(req.images):
            out[g, : len(req.images)] = req.images
    return out


def _key_data(keys):
    """Requests' keys as one array of key data (`jax.random.key_data`): on the host when every
    request brought its key's data, else stacked on the device."""
    if all(isinstance(k, np.ndarray) for k in keys):
        return np.stack(keys)
    return jax.random.key_data(jnp.stack([jax.random.wrap_key_data(k) if isinstance(k, np.ndarray)
                                          else k for k in keys]))  # fmt: skip
