"""RL across processes: every process draws the same prompts, samples and scores its share of
them on its own devices, and gets everyone's completions and rewards back in prompt order.

So every process holds the whole step's rollouts, builds the same global batch and host
metrics as one process would, and feeds its own rows of it (`process_rows`). Only token ids,
log-probs and rewards cross hosts (a few KB a step); the weights each process samples with are
its own copy (`to_process_local`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from posttrain.envs import FINISH_REASONS, Episode
from posttrain.parallel import exchange, fetch
from posttrain.sampling import Completion

# An episode's counts that cross with it (its metrics are over every process's episodes).
_EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors", "tool_s", "recovered")


def prompt_share(prompts: int, process: int | None = None) -> slice:
    """This process's (or `process`'s) contiguous share of a step's `prompts` (whole groups;
    the last processes' shares may be shorter or empty)."""
    per = -(-prompts // jax.process_count())
    start = min(prompts, per * (jax.process_index() if process is None else process))
    return slice(start, min(prompts, start + per))


def gather_groups(
    completions,
    rewards: np.ndarray,
    prompts: int,
    G: int,
    *,
    channel: str,
    label: str,
    episodes: bool = False,
):
    """Every process's `(completions per prompt, rewards [share, G])`, concatenated in prompt
    order: `(completions, rewards [prompts, G])` on every process. The gathered completions
    carry their text, ids, log-probs and finish reasons (rejection sampling trains on the
    text), with partial rollouts the version of the weights of each token, and, under router
    replay, the experts each position was routed to; `episodes`
    (multi-turn): they are `Episode`s, and carry their prompt (rendered with the tools), loss
    mask, finish reason and counts too (not their messages or records).

    The exchange goes through the host (`posttrain.parallel.exchange` on `channel`, checked
    against `label`): it queues no program on any device, so a decoupled sampler's thread and
    the trainer's never order programs spanning processes differently on two processes."""
    flat = [c for group in completions for c in group]
    texts = [None if c.text is None else c.text.encode() for c in flat]
    local = {
        "text": np.frombuffer(b"".join(t or b"" for t in texts), np.uint8),
        "text_lengths": np.asarray([-1 if t is None else len(t) for t in texts], np.int64),
        "ids": np.asarray([t for c in flat for t in c.token_ids], np.int32),
        "logps": np.asarray([x for c in flat for x in c.logprobs], np.float32),
        "lengths": np.asarray([len(c.token_ids) for c in flat], np.int32),
        "truncated": np.asarray([c.finish_reason == "length" for c in flat], bool),
        "scores": np.asarray(rewards, np.float32).reshape(len(completions), G),
    }
    versions = [getattr(c, "versions", None) for c in flat]  # (partial rollouts': per token)
    if flat and all(v is not None for v in versions):
        local["versions"] = np.asarray([v for vs in versions for v in vs], np.int64)
    routes = [r for c in flat if (r := getattr(c, "routed_experts", None)) is not None]
    if routes:  # router replay: int16 [positions, MoE layers, top-k] per completion
        local.update(
            routes=np.concatenate([r.reshape(len(r), -1) for r in routes]),
            route_lengths=np.asarray([len(r) for r in routes], np.int64),
            route_shape=np.asarray(routes[0].shape[1:], np.int64),
        )
    if episodes:
        local.update(
            prompt_ids=np.asarray([t for c in flat for t in c.prompt_ids], np.int32),
            prompt_lengths=np.asarray([len(c.prompt_ids) for c in flat], np.int32),
            mask=np.asarray([m for c in flat for m in c.mask], np.int8),
            finish=np.asarray([FINISH_REASONS.index(c.finish_reason) for c in flat], np.int8),
            **{k: np.asarray([getattr(c, k) for c in flat], np.float64) for k in _EPISODE_COUNTS},
        )
    out, scores = [], []
    for theirs in exchange(channel, label, local):
        ends = np.cumsum(theirs["lengths"])
        starts = ends - theirs["lengths"]
        sizes = theirs["text_lengths"]
        text_ends = np.cumsum(np.maximum(sizes, 0))
        blob = theirs["text"].tobytes()
        texts = [
            None if n < 0 else blob[e - n : e].decode()
            for n, e in zip(sizes, text_ends, strict=True)
        ]
        theirs_flat = [
            Completion(
                text,
                tuple(int(t) for t in theirs["ids"][a:b]),
                tuple(float(x) for x in theirs["logps"][a:b]),
                "length" if cut else "stop",
            )
            for a, b, cut, text in zip(starts, ends, theirs["truncated"], texts, strict=True)
        ]
        if "versions" in theirs:
            theirs_flat = [
                dataclasses.replace(c, versions=tuple(int(v) for v in theirs["versions"][a:b]))
                for c, a, b in zip(theirs_flat, starts, ends, strict=True)
            ]
        if "routes" in theirs:
            theirs_flat = _with_routes(theirs, theirs_flat)
        if episodes:
            theirs_flat = _episodes(theirs, theirs_flat, starts, ends)
        out += [theirs_flat[i : i + G] for i in range(0, len(theirs_flat), G)]
        scores.append(theirs["scores"].reshape(-1, G))
    if len(out) != prompts:
        raise ValueError(f"the processes sampled {len(out)} prompt groups of {prompts}")
    return out, np.concatenate(scores).astype(np.float32)


def _with_routes(theirs: dict, completions: list) -> list[Completion]:
    """A process's gathered completions with the experts they were routed to (`gather_groups`)."""
    ends = np.cumsum(theirs["route_lengths"])
    shape = tuple(int(n) for n in theirs["route_shape"])
    return [
        dataclasses.replace(c, routed_experts=theirs["routes"][b - n : b].reshape(n, *shape))
        for c, n, b in zip(completions, theirs["route_lengths"], ends, strict=True)
    ]


def _episodes(theirs: dict, completions: list, starts, ends) -> list[Episode]:
    """A process's gathered episodes, rebuilt from what crossed (`gather_groups`)."""
    prompt_ends = np.cumsum(theirs["prompt_lengths"])
    prompt_starts = prompt_ends - theirs["prompt_lengths"]
    out = []
    for i, c in enumerate(completions):
        counts = {k: theirs[k][i] for k in _EPISODE_COUNTS}
        out.append(
            Episode(
                record={},
                prompt_ids=[
                    int(t) for t in theirs["prompt_ids"][prompt_starts[i] : prompt_ends[i]]
                ],
                token_ids=list(c.token_ids),
                logprobs=list(c.logprobs),
                mask=[int(m) for m in theirs["mask"][starts[i] : ends[i]]],
                finish_reason=FINISH_REASONS[theirs["finish"][i]],
                text=c.text or "",
                turns=int(counts["turns"]),
                tool_calls=int(counts["tool_calls"]),
                tool_errors=int(counts["tool_errors"]),
                tool_s=float(counts["tool_s"]),
                recovered=bool(counts["recovered"]),
            )
        )
    return out


def host_array(x: jax.Array) -> np.ndarray:
    """The whole value of a (batch-sharded) global array on every process, gathered on the
    devices that hold it."""
    return np.asarray(fetch(x))
