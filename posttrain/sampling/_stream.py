"""Token-by-token generation for one prompt, yielding text as it is produced (the CLI's path).

The same model code, cache and sampler as `generate`; the host loop costs a device round trip
per token, which is what an interactive terminal wants and what batch rollouts avoid.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp

from posttrain.models import Transformer, init_cache
from posttrain.sampling._sample import sample_tokens


@functools.partial(jax.jit, static_argnames=("max_len",))
def _prefill(model: Transformer, tokens_1P, *, max_len: int):
    cache = init_cache(model.config, 1, max_len)
    P = tokens_1P.shape[1]
    logits, cache = model(
        tokens_1P, jnp.arange(P, dtype=jnp.int32)[None], jnp.ones((1, P), jnp.int32), cache
    )
    return logits[:, -1], cache


@jax.jit
def _step(model: Transformer, cache, logits_1V, rng, position, temperature, top_k, top_p):
    token = sample_tokens(rng, logits_1V, temperature=temperature, top_k=top_k, top_p=top_p)
    logits, cache = model(token[:, None], position[None, None], jnp.ones((1, 1), jnp.int32), cache)
    return token[0], logits[:, 0], cache


def stream(
    model: Transformer,
    tokenizer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[str]:
    """Yields the decoded continuation of `prompt_ids` piece by piece until EOS or the limit."""
    limit = model.config.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens="
            f"{max_new_tokens} that exceeds the model's context ({limit})"
        )
    logits, cache = _prefill(
        model, jnp.asarray([list(prompt_ids)], jnp.int32), max_len=len(prompt_ids) + max_new_tokens
    )
    rng = jax.random.key(seed)
    generated: list[int] = []
    shown = ""
    for i in range(max_new_tokens):
        token, logits, cache = _step(
            model,
            cache,
            logits,
            jax.random.fold_in(rng, i),
            jnp.int32(len(prompt_ids) + i),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
        )
        token = int(token)
        if token in tokenizer.eos_ids:
            break
        generated.append(token)
        text = tokenizer.decode(generated)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            yield text[len(shown) :]
            shown = text
