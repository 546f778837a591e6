"""What generation returns (`Completion`) and the host-side steps every decoding path shares:
checking the settings, encoding prompts within the model's context, keying samples, cutting a
sample at its first stop string."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.sampling._params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt.

    Attributes:
      text: the decoded continuation (special tokens skipped), cut before the first stop string;
        None when `generate` had no tokenizer.
      token_ids: the generated ids, including the EOS id or the token that completed a stop
        string, nothing after it.
      logprobs: log p(token) of each id in `token_ids` under the raw model distribution
        (temperature 1, no top-k/top-p), as RL importance ratios need.
      finish_reason: "stop" (EOS or a stop string) or "length" (max_new_tokens reached).
      routed_experts: router replay (the engine's `record_routes`): the experts each position
        of prompt + `token_ids` was routed to, int16 `[tokens, MoE layers, top-k]`; else None.
      versions: partial rollouts: the version of the weights that decoded each token; else None.
    """

    text: str | None
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    routed_experts: np.ndarray | None = dataclasses.field(default=None, compare=False)
    versions: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)

    @property
    def truncated(self) -> bool:
        """Cut at max_new_tokens."""
        return self.finish_reason == "length"


def _check(prompts, *, max_new_tokens, temperature, top_p, top_k, n, length_bucket):
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    check_settings(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n
    )
    if length_bucket < 1:
        raise ValueError(f"length_bucket must be >= 1, got {length_bucket}")


def check_settings(*, max_new_tokens: int, temperature: float, top_p: float, top_k: int, n: int):
    """Raises a ValueError naming the first sampling setting out of range."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    SamplingParams(temperature, top_p, top_k)
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")


def _encode(tokenizer, prompts) -> list[list[int]]:
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is a string; pass a tokenizer or token-id lists")
            # Rendered chat prompts already start with BOS; do not add a second one.
            p = tokenizer.encode(prompt)
            if tokenizer.adds_bos and p[1:2] == [tokenizer.bos_id]:
                p = p[1:]
        else:
            p = [int(t) for t in prompt]
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        ids.append(p)
    return ids


def _prepare(model, tokenizer, prompts, budgets, stop, eos_ids):
    """Host-side setup of a generation call (and the tests' reference loop): encoded prompts
    (each within the model's context with its token budget), stop strings, EOS ids, pad id."""
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer to decode the generated text")
    ids = _encode(tokenizer, prompts)
    limit = model.config.max_seq_len
    for i, (p, budget) in enumerate(zip(ids, budgets, strict=True)):
        if len(p) + budget > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={budget} that exceeds "
                f"the model's context (max_seq_len={limit}); shorten the prompt or lower "
                f"max_new_tokens"
            )
    if eos_ids is None:
        eos_ids = () if tokenizer is None else tokenizer.eos_ids
    pad_id = 0 if tokenizer is None or tokenizer.pad_id is None else tokenizer.pad_id
    return ids, stop, tuple(eos_ids), pad_id


def _finish(tokenizer, ids, logprobs, hit_eos, stop) -> Completion:
    """Host-side: decode, cut at the first stop string (and the tokens after it)."""
    if tokenizer is None:
        return Completion(None, tuple(ids), tuple(logprobs), "stop" if hit_eos else "length")
    text = tokenizer.decode(ids)
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut < 0:
        return Completion(text, tuple(ids), tuple(logprobs), "stop" if hit_eos else "length")
    # The shortest token prefix whose text holds a stop string (binary search: prefixes grow).
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid]) for s in stop):
            hi = mid
        else:
            lo = mid + 1
    return Completion(text[:cut], tuple(ids[:lo]), tuple(logprobs[:lo]), "stop")


def _keys(seed: int, seeds: Sequence[int] | None, prompts: int):
    """Prompt i's key `[prompts]`: `key(seeds[i])`, or `fold_in(key(seed), i)` (every decoding
    path keys a prompt this way, so they draw the same samples)."""
    if seeds is None:
        return jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(prompts))
    if len(seeds) != prompts:
        raise ValueError(f"{len(seeds)} seeds for {prompts} prompts")
    return jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seeds, np.uint32)))
