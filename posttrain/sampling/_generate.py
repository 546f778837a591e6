"""`generate`: n samples of each prompt, the whole call at once, on the one decoder.

Every model decodes on the paged engine (`generate_continuous` with a row for each sample; a
Flax NNX module, which has no KV cache, reruns over each row's tokens there). The weights are
an argument of the jitted functions (`model` is a pytree whose config is static), so RL can
pass fresh params of the same shapes without recompiling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posttrain.models import Transformer
from posttrain.sampling._completion import Completion, _check
from posttrain.sampling._continuous import generate_continuous
from posttrain.sampling._engine_config import EngineConfig

MOST_ROWS = 256  # rows `generate` decodes at once; the engine queues the rest


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
    engine: EngineConfig | None = None,
) -> list[list[Completion]]:
    """Samples `n` continuations of each prompt on the paged engine (`generate_continuous`),
    every sample of the call decoding at once (up to 256 rows; more wait for a free row).

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
      seed: PRNG seed; the same seed, prompts and settings give the same outputs (prompt i
        draws from `fold_in(key(seed), i)`).
      seeds: one seed per prompt instead of `seed`: a prompt's samples then depend only on
        its own seed, not on the other prompts of the batch or its row (RL across processes
        samples each process's share of a step's prompts and must draw what one process does).
      stop: string(s) that end a sample; the text is cut before the first one.
      eos_ids: ids that end a sample; default `tokenizer.eos_ids` (none without a tokenizer).
      length_bucket: prefill lengths are padded to a multiple of this, so prompt lengths in
        the same bucket share one compilation.
      images: a VLM's images per prompt, float pixels `[H, W, C]` each, resized and
        normalised (`posttrain.data.preprocess_images`); prompt i's image tokens take its
        images in order.
      engine: the engine's settings (rows, KV cache, chunk, prefill bucket, prompt-lookup
        drafts); default: a row per sample (up to 256), prompts padded to `length_bucket`
        (`slots=0` sizes the rows so too).

    Returns:
      Per prompt, a list of its n `Completion`s (text, token_ids, logprobs, finish_reason). The
      log-probs are those of the raw model distribution, not the temperature/top-k/top-p one.

    Raises:
      ValueError: empty prompts, a prompt longer than `model.config.max_seq_len -
        max_new_tokens`, n < 1, top_p outside (0, 1], or other out-of-range settings.
    """
    _check(  # (before `len(prompts)` below)
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n=n,
        length_bucket=length_bucket,
    )
    return generate_continuous(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, top_k=top_k, n=n, seed=seed, seeds=seeds, stop=stop, eos_ids=eos_ids,
        slots=min(len(prompts) * n, MOST_ROWS), length_bucket=length_bucket, images=images,
        config=engine,
    )  # fmt: skip
