"""Static-batch generation: one jitted prefill + decode loop per (batch size, prompt bucket).

Prompts are left-padded to a multiple of `length_bucket`, so every row's last prompt token sits
in the same slot and all rows write each decoded token at the same cache slot. Padding has
segment id 0 and real tokens 1, so padding is never attended by (nor attends) real tokens;
positions count from 0 at each row's first real token, as if the prompt were alone.

The weights are an argument of the jitted function (`model` is a pytree whose config is
static), so RL can pass fresh params of the same shapes without recompiling.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models import Transformer, hidden_states, init_cache, lm_logits
from posttrain.sampling._sample import sample_tokens


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
    `rng` is one key for the batch or a key per prompt `[B]` (see `generate`'s `seeds`)."""
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
    if rng.ndim:  # sample j of prompt i draws from fold_in(key_i, j), whatever else is batched
        rng = jax.vmap(jax.random.fold_in)(jnp.repeat(rng, n), jnp.tile(jnp.arange(n), B))
    B *= n

    def draw(key, logits_BV):
        kwargs = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        if key.ndim == 0:
            return sample_tokens(key, logits_BV, **kwargs)
        one = lambda k, l_V: sample_tokens(k, l_V[None], **kwargs)[0]  # noqa: E731
        return jax.vmap(one)(key, logits_BV)

    def cond(state):
        step, _, _, _, _, _, done_B = state
        return (step < max_new_tokens) & ~jnp.all(done_B)

    def body(state):
        step, cache, logits_BV, tokens_BN, logprobs_BN, num_B, done_B = state
        fold = jax.vmap(jax.random.fold_in, (0, None)) if rng.ndim else jax.random.fold_in
        token_B = draw(fold(rng, step), logits_BV)
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
    if not (temperature >= 0 and math.isfinite(temperature)):  # (NaN compares False)
        raise ValueError(
            f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}"
        )
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
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
    """Host-side setup shared by the static and continuous paths: encoded prompts (each within
    the model's context with its token budget), stop strings, EOS ids and the pad id."""
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
    if seeds is None:
        return jax.random.key(seed)
    if len(seeds) != prompts:
        raise ValueError(f"{len(seeds)} seeds for {prompts} prompts")
    return jax.vmap(jax.random.key)(jnp.asarray(np.asarray(seeds, np.uint32)))


def generate(
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
    """Samples `n` continuations of each prompt with a KV cache, all rows in one static batch.

    Args:
      model: the `Transformer` (its params are a jit argument: new weights do not recompile).
      tokenizer: a `posttrain.data.Tokenizer`; may be None when prompts are token-id lists
        (then `Completion.text` is None and stop strings are not available).
      prompts: rendered prompt strings (encoded with the tokenizer's special tokens, without
        doubling a BOS the text already has) or token-id lists.
      max_new_tokens: most tokens generated per sample.
      temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
      top_p: nucleus sampling, in (0, 1]: keep the most likely tokens until their probability
        reaches top_p.
      top_k: keep only the k most likely tokens; 0 keeps all.
      n: samples per prompt; they share the prompt's prefill.
      seed: PRNG seed; the same seed, prompts and settings give the same outputs.
      seeds: one seed per prompt instead of `seed`: a prompt's samples then depend only on
        its own seed, not on the other prompts of the batch or its row (RL across processes
        samples each process's share of a step's prompts and must draw what one process does).
      stop: string(s) that end a sample; the text is cut before the first one.
      eos_ids: ids that end a sample; default `tokenizer.eos_ids` (none without a tokenizer).
      length_bucket: prompts are left-padded to a multiple of this, so prompt lengths in the
        same bucket share one compilation.
      images: a VLM's images per prompt, float pixels `[H, W, C]` each, resized and
        normalised (`posttrain.data.preprocess_images`); prompt i's image tokens take its
        images in order.

    Returns:
      Per prompt, a list of its n `Completion`s (text, token_ids, logprobs, finish_reason). The
      log-probs are those of the raw model distribution, not the temperature/top-k/top-p one.

    Raises:
      ValueError: empty prompts, a prompt longer than `model.config.max_seq_len -
        max_new_tokens`, n < 1, top_p outside (0, 1], or other out-of-range settings.
    """
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
