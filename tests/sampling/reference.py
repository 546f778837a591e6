"""The reference decoder the engine is tested against: one padded batch per call through the
dense `KVCache` (an NNX module: its token buffer, `NNXCache`), every row decoding in lockstep.

This was posttrain's static sampler; the paged engine is now the only decoder in the package,
and this loop stays here as an independent implementation of the same contract: prompts
left-padded to a multiple of `length_bucket` so every row's last prompt token sits in the same
slot, padding in segment 0 (never attended), positions from 0 at each row's first real token,
and the engine's keying (prompt i's samples keyed by `seeds[i]` or `fold_in(key(seed), i)`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import Transformer, hidden_states, init_cache, lm_logits
from posttrain.sampling._completion import Completion, _check, _finish, _keys, _prepare
from posttrain.sampling._sample import sample_tokens


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "n"))
def _generate_padded(
    model: Transformer,
    tokens_BP,
    lengths_B,
    eos_E,
    rng,
    temperature,
    top_k,
    top_p,
    images_BIHWC=None,
    *,
    max_new_tokens: int,
    n: int,
):
    """Prefill left-padded prompts (with a VLM's images), repeat each row n times, decode; returns
    (tokens `[B*n, max_new_tokens]`, logprobs, number generated `[B*n]`, hit EOS `[B*n]`).
    `rng` is a key per prompt `[B]`."""
    config, params = model.config, model.params
    B, P = tokens_BP.shape
    pad_B1 = (P - lengths_B)[:, None]
    slot_1P = jnp.arange(P, dtype=jnp.int32)[None]
    real_BP = slot_1P >= pad_B1
    positions_BP = jnp.where(real_BP, slot_1P - pad_B1, 0)
    cache = init_cache(config, B, P + max_new_tokens)
    hidden_BPD, cache = hidden_states(
        params, tokens_BP, config, positions_BP, real_BP.astype(jnp.int32), cache,
        images_BIHWC=images_BIHWC,
    )  # fmt: skip
    logits_BV = lm_logits(params, hidden_BPD[:, -1:], config)[:, 0]

    # The n samples of a prompt share its prefill: repeat cache rows, not the prompt.
    cache = cache.repeat(n)
    logits_BV = jnp.repeat(logits_BV, n, axis=0)
    lengths_B = jnp.repeat(lengths_B, n, axis=0)
    # Sample j of prompt i draws from fold_in(key_i, j), whatever else is batched.
    rng = jax.vmap(jax.random.fold_in)(jnp.repeat(rng, n), jnp.tile(jnp.arange(n), B))
    B *= n

    def draw(key_B, logits_BV):
        kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        one = lambda k, l_V: sample_tokens(k, l_V[None], **kwargs)[0]  # noqa: E731
        return jax.vmap(one)(key_B, logits_BV)

    def cond(state):
        step, _, _, _, _, _, done_B = state
        return (step < max_new_tokens) & ~jnp.all(done_B)

    def body(state):
        step, cache, logits_BV, tokens_BN, logprobs_BN, num_B, done_B = state
        token_B = draw(jax.vmap(jax.random.fold_in, (0, None))(rng, step), logits_BV)
        logprob_B = jnp.take_along_axis(
            jax.nn.log_softmax(logits_BV, axis=-1), token_B[:, None], axis=-1
        )[:, 0]
        token_B = jnp.where(done_B, 0, token_B)
        tokens_BN = tokens_BN.at[:, step].set(token_B)
        logprobs_BN = logprobs_BN.at[:, step].set(jnp.where(done_B, 0.0, logprob_B))
        num_B += ~done_B
        done_B |= jnp.isin(token_B, eos_E)
        logits_B1V, cache = model(
            token_B[:, None],
            (lengths_B + step)[:, None],
            jnp.ones((B, 1), jnp.int32),
            cache,
        )
        return step + 1, cache, logits_B1V[:, 0], tokens_BN, logprobs_BN, num_B, done_B

    state = (
        jnp.zeros((), jnp.int32),
        cache,
        logits_BV,
        jnp.zeros((B, max_new_tokens), jnp.int32),
        jnp.zeros((B, max_new_tokens), jnp.float32),
        jnp.zeros((B,), jnp.int32),
        jnp.zeros((B,), bool),
    )
    _, _, _, tokens_BN, logprobs_BN, num_B, done_B = jax.lax.while_loop(cond, body, state)
    return tokens_BN, logprobs_BN, num_B, done_B


def _images(config, images, rows: int):
    """Per-prompt image lists as one `[rows, most images, H, W, C]` array (unused slots 0)."""
    if images is None:
        return None
    if config.vision is None:
        raise ValueError(f"model {config.name!r} has no vision encoder; it takes no images")
    if len(images) != rows:
        raise ValueError(f"images: {len(images)} lists for {rows} prompts; give one per prompt")
    v = config.vision
    out = np.zeros((rows, max(1, *map(len, images)), v.image_size, v.image_size, v.channels))
    for row, row_images in zip(out, images, strict=True):
        for i, image in enumerate(row_images):
            row[i] = image
    return jnp.asarray(out, jnp.float32)


def generate_static(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    n: int = 1,
    seed: int = 0,
    seeds: Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    eos_ids: Sequence[int] | None = None,
    length_bucket: int = 64,
    images: Sequence[Sequence[np.ndarray]] | None = None,
) -> list[list[Completion]]:
    """`generate` on the padded loop: the decoder of a module without a KV-cache interface
    (a Flax NNX module), and the reference the engine is tested against (any model). Same
    arguments, checks and results as `generate`, and the engine's draws: prompt i's samples are
    keyed by `seeds[i]` or `fold_in(key(seed), i)` on both."""
    _check(
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n=n,
        length_bucket=length_bucket,
    )
    ids, stop, eos_ids, pad_id = _prepare(
        model, tokenizer, prompts, [max_new_tokens] * len(prompts), stop, eos_ids
    )
    P = -(-max(len(p) for p in ids) // length_bucket) * length_bucket
    tokens_BP = np.full((len(ids), P), pad_id, np.int32)
    for row, p in zip(tokens_BP, ids, strict=True):
        row[P - len(p) :] = p
    tokens, logprobs, num, hit_eos = jax.device_get(
        _generate_padded(
            model,
            jnp.asarray(tokens_BP),
            jnp.asarray([len(p) for p in ids], jnp.int32),
            jnp.asarray(list(eos_ids) or [-1], jnp.int32),
            _keys(seed, seeds, len(ids)),
            jnp.float32(temperature),
            jnp.int32(top_k),
            jnp.float32(top_p),
            _images(model.config, images, len(ids)),
            max_new_tokens=max_new_tokens,
            n=n,
        )
    )
    out = []
    for i in range(len(ids)):
        samples = []
        for j in range(i * n, (i + 1) * n):
            k = int(num[j])
            row_ids = [int(t) for t in tokens[j, :k]]
            row_lp = [float(x) for x in logprobs[j, :k]]
            samples.append(_finish(tokenizer, row_ids, row_lp, bool(hit_eos[j]), stop))
        out.append(samples)
    return out
