"""What a caller asks the generation engine for, and what the engine fills in as it runs."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from posttrain.sampling._params import SamplingParams


@dataclasses.dataclass
class Kept:
    """KV blocks a finished sample left in the engine's pool (`Request.keep`): they hold the
    keys and values of its first `length` tokens (prompt and sampled). Pass them on as the
    `cached` of the request that continues that sequence, or give them back
    (`Engine.release`); until then they are the caller's."""

    blocks: list[int]
    length: int


@dataclasses.dataclass
class Request:
    """A prompt and what to generate for it: `n` samples of at most `max_new_tokens` each,
    sample j keyed `fold_in(key, j)` (and a VLM's `images`, which its image tokens take in
    order; prefilled once for the n samples). Filled in as it runs: `tokens`/`logprobs` per sample
    and `done` per sample; with `EngineConfig.record_routes`, `routes` per finished sample
    (int16 `[prompt + tokens, MoE layers, top-k]`, None if cancelled); `versions` per sample:
    the engine's `version` (its weights' version) when each token was decoded.

    `keep`: a finished sample leaves its KV blocks in the pool, as `kept[j]` (a `Kept`; None
    where the engine cannot keep them: see `Engine.keeps_kv`). `cached`: the blocks a sample
    kept whose tokens begin this prompt (a conversation's next turn, n=1): only the prompt's
    tokens past them are prefilled, and the blocks become this request's."""

    prompt: list[int]
    max_new_tokens: int
    key: jax.Array | np.ndarray  # a PRNG key, or its data (`jax.random.key_data`) on the host
    n: int = 1
    sampling: SamplingParams = SamplingParams()
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    logprobs: list[list[float]] = dataclasses.field(default_factory=list)
    done: list[bool] = dataclasses.field(default_factory=list)
    routes: list = dataclasses.field(default_factory=list)
    versions: list[list[int]] = dataclasses.field(default_factory=list)
    admitted: int = 0  # samples placed in rows so far
    images: np.ndarray | None = None  # a VLM's prompt images, float32 [I, H, W, C]
    keep: bool = False
    cached: Kept | None = None
    kept: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.done = [False] * self.n
        self.routes = [None] * self.n
        self.versions = [[] for _ in range(self.n)]
        self.kept = [None] * self.n
