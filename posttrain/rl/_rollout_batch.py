"""The training batch of rollouts: fixed-shape arrays of sampled groups (`rollout_batch`).

Each prompt has `G` sampled completions (multi-turn: `G` episodes); its group occupies `G`
consecutive rows. A row holds `prompt + completion` (right-padded to `max_len`), with the loss
mask on the positions whose target is a completion token (the EOS that ended it included; an
episode's observation tokens excluded) and the sampler's log-prob of each such target. Rows of
groups that were dropped or never filled (dynamic sampling) are
fillers: no tokens, no loss, domain id -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.data import ImageSpec, pixel_rows, prompt_pixels
from posttrain.sampling import Completion


def rollout_batch(
    prompts: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[Completion]],
    rewards: np.ndarray,
    *,
    groups: int,
    max_len: int,
    pad_id: int = 0,
    route_shape: tuple[int, int] | None = None,
    images: ImageSpec | None = None,
) -> dict[str, np.ndarray]:
    """Arrays for `groups` groups of `G = len(completions[0])` rows (fillers past the data).

    Args:
      prompts: `PromptData` prompts (`prompt_ids`, `domain_id`), one per group.
      completions: per prompt, its G completions.
      rewards: `[len(prompts), G]` scalar rewards.
      groups: groups in the batch (its rows = groups * G).
      max_len: row length; prompt + completion must fit.
      pad_id: the token id of padding.
      route_shape: router replay: `(MoE layers, top-k)` of the completions' `routed_experts`,
        laid out by position as `routed_experts` (int16 `[rows, max_len, *route_shape]`, -1
        where nothing was sampled); None: no routing.
      images: a VLM's: each row gets its prompt's images (`images` float32
        `[rows, max_images, S, S, C]`, zeros in unused slots and on fillers).

    Returns:
      `tokens`, `targets`, `positions`, `segment_ids` (int32) and `loss_mask`,
      `sampler_logps` (float32), each `[rows, max_len]`; `rewards`, `lengths` (completion
      tokens), `truncated` (1.0 where the completion hit max_new_tokens) as float32 `[rows]`;
      `domain_ids` (int32 `[rows]`, -1 on fillers).
    """
    if len(prompts) > groups:
        raise ValueError(f"{len(prompts)} prompt groups do not fit a batch of {groups}")
    G = len(completions[0]) if completions else 1
    rows = groups * G
    out = {k: np.zeros((rows, max_len), np.int32) for k in ("tokens", "targets", "positions")}
    out["tokens"][:] = pad_id
    out["segment_ids"] = np.zeros((rows, max_len), np.int32)
    out["loss_mask"] = np.zeros((rows, max_len), np.float32)
    out["sampler_logps"] = np.zeros((rows, max_len), np.float32)
    for k in ("rewards", "lengths", "truncated"):
        out[k] = np.zeros(rows, np.float32)
    out["domain_ids"] = np.full(rows, -1, np.int32)
    if route_shape is not None:
        out["routed_experts"] = np.full((rows, max_len, *route_shape), -1, np.int16)
    for g, (prompt, group) in enumerate(zip(prompts, completions, strict=True)):
        if len(group) != G:
            raise ValueError(f"prompt {g} has {len(group)} completions, expected {G}")
        for j, c in enumerate(group):
            r = g * G + j
            # An episode (multi-turn) has its own prompt (rendered with its tools) and a mask
            # that leaves the environment's tokens out of the loss.
            p = getattr(c, "prompt_ids", None) or prompt["prompt_ids"]
            ids = [*p, *c.token_ids]
            n = len(ids)
            if n > max_len:
                raise ValueError(f"prompt + completion has {n} tokens, more than max_len={max_len}")
            out["tokens"][r, :n] = ids
            out["targets"][r, : n - 1] = ids[1:]
            out["positions"][r, :n] = np.arange(n)
            out["segment_ids"][r, :n] = 1
            # Position t predicts token t + 1: the completion's tokens are targets from the
            # prompt's last position on.
            k = len(c.token_ids)
            mask = getattr(c, "mask", None)
            out["loss_mask"][r, len(p) - 1 : len(p) - 1 + k] = 1.0 if mask is None else mask
            out["sampler_logps"][r, len(p) - 1 : len(p) - 1 + k] = c.logprobs
            out["rewards"][r] = rewards[g][j]
            out["lengths"][r] = k
            out["truncated"][r] = float(c.truncated)
            out["domain_ids"][r] = prompt["domain_id"]
            if route_shape is not None:
                if c.routed_experts is None or len(c.routed_experts) != n:
                    raise ValueError(f"completion {j} of prompt {g} has no routing for each token")
                out["routed_experts"][r, :n] = c.routed_experts
    if images is not None:  # each row its prompt's images; fillers none
        out["images"] = pixel_rows([prompt_pixels(p, images) for p in prompts for _ in range(G)],
                                   images, rows)  # fmt: skip
    return out


def split_rows(batch: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """`parts` mini-batches of the rows (every parts-th row, so each mixes many groups)."""
    return [{k: v[i::parts] for k, v in batch.items()} for i in range(parts)]
