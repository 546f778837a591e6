"""Continuous batching over the paged engine (`posttrain.sampling._engine`): `slots` rows decode
together, a row whose sample ends takes the next waiting one, the n samples of a prompt share its
prefill and full KV blocks. Same arguments and results as `generate`, plus the engine's knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.sampling._completion import Completion, _check, _finish, _keys, _prepare
from posttrain.sampling._engine import Engine, Request
from posttrain.sampling._engine_config import EngineConfig
from posttrain.sampling._params import SamplingParams
from posttrain.sampling._speculative import MTP, DraftModel, PromptLookup, check_drafter


def generate_continuous(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    slots: int = 8,
    chunk: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    n: int = 1,
    seed: int = 0,
    seeds: Sequence[int] | None = None,
    stop: str | Sequence[str] | None = None,
    eos_ids: Sequence[int] | None = None,
    length_bucket: int = 16,
    block_size: int = 16,
    num_blocks: int = 0,
    kv_dtype: str = "auto",
    prefix_sharing: bool = True,
    record_routes: bool = False,
    drafter: PromptLookup | DraftModel | MTP | None = None,
    engine: Engine | None = None,
    config: EngineConfig | None = None,
    max_len: int = 0,
    stats: dict | None = None,
    images: Sequence[Sequence[np.ndarray]] | None = None,
) -> list[list[Completion]]:
    """Like `generate`, on the paged continuous-batching engine: `slots` rows decode at once,
    a row whose sample ends takes the next waiting one, so a few long samples do not idle the
    batch, and the n samples of a prompt share its prefill.

    Args:
      model: the `Transformer` (its params are a jit argument: new weights do not recompile).
      tokenizer: a `posttrain.data.Tokenizer`, or None for token-id prompts.
      prompts: rendered prompt strings or token-id lists, as for `generate`.
      max_new_tokens: most tokens generated per sample; one int, or one per prompt.
      slots: rows decoded together.
      chunk: decode steps per jitted call; the host refills finished rows between calls.
      temperature, top_p, top_k, stop, eos_ids: as for `generate`.
      n: samples per prompt.
      seed, seeds: as for `generate`: sample j of prompt i draws its k-th token with
        `fold_in(fold_in(key_i, j), k)`, `key_i = key(seeds[i])` or `fold_in(key(seed), i)`;
        outputs do not depend on `slots`, `chunk` or the other prompts (up to float
        rounding), and with `seeds` they are `generate`'s draws.
      length_bucket: prefill lengths are padded to a multiple of this.
      block_size, num_blocks, kv_dtype, prefix_sharing: the KV pool (see `EngineConfig`).
      record_routes: a MoE model's completions carry the experts every position (prompt
        and completion) was routed to, `Completion.routed_experts` (router replay).
      drafter: decode speculatively: `PromptLookup(ngram, k)`, `DraftModel(model, k)` (same
        vocabulary) or `MTP(module, k)` (the model's own MTP module, `mtp_from_hf`) (same
        outputs when greedy, the same distribution when sampling, fewer forwards of `model`
        when drafts are accepted; see `Engine`).
      engine: an `Engine` to run on (keeps its compilations and pool across calls, e.g. one
        per RL run); the engine arguments above are then ignored, except the model's weights,
        which are swapped in.
      config: the engine's settings as one record (`EngineConfig`, e.g. an eval config's
        `engine`), instead of the engine arguments above.
      max_len: tokens per sequence the engine is made for (0: this call's longest prompt plus
        its budget); a caller that generates again and again with other prompts fixes it, so
        every call runs the same compiled programs.
      stats: if given, filled with this call's `EngineStats` counts (prompt vs prefilled
        tokens, generated tokens, device calls, speculative rounds and drafts).
      images: a VLM's images per prompt, as for `generate`; a prompt's n samples share its
        prefill, images included.

    Returns:
      Per prompt, a list of its n `Completion`s. Greedy outputs equal `generate`'s.

    Raises:
      ValueError: as `generate`, plus engine settings out of range, or a max_new_tokens list
        whose length is not the number of prompts.
    """
    budgets = (
        [max_new_tokens] * len(prompts)
        if isinstance(max_new_tokens, int | np.integer)
        else [int(m) for m in max_new_tokens]
    )
    if len(budgets) != len(prompts):
        raise ValueError(
            f"max_new_tokens has {len(budgets)} entries for {len(prompts)} prompts; pass one "
            f"int or one per prompt"
        )
    _check(
        prompts,
        max_new_tokens=min(budgets),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        n=n,
        length_bucket=length_bucket,
    )
    sampling = SamplingParams(temperature, top_p, top_k)
    ids, stop, eos_ids, _ = _prepare(model, tokenizer, prompts, budgets, stop, eos_ids)
    if engine is None:
        rows = min(len(prompts) * n, 256)
        config = (
            config.sized(rows)
            if config
            else EngineConfig(
                slots=slots,
                block_size=block_size,
                num_blocks=num_blocks,
                chunk=chunk,
                prefill_bucket=length_bucket,
                kv_dtype=kv_dtype,
                prefix_sharing=prefix_sharing,
                record_routes=record_routes,
            )
        )
        longest = max(len(p) + b for p, b in zip(ids, budgets, strict=True))
        if max_len and longest > max_len:
            raise ValueError(
                f"a prompt and its budget take {longest} tokens, more than max_len={max_len}"
            )
        max_len = max_len or longest
        engine = Engine(model, config, max_len=max_len, eos_ids=eos_ids, drafter=drafter)
    else:
        engine.model = model
        engine.set_eos(eos_ids)
    keys = _keys(seed, seeds, len(ids))
    # Each request's key as host data: submitting a prompt costs no device call.
    keys = np.asarray(jax.random.key_data(keys))
    if images is not None and len(images) != len(ids):
        raise ValueError(f"images: {len(images)} lists for {len(ids)} prompts; give one per prompt")
    requests = [
        engine.submit(
            Request(
                prompt=p,
                max_new_tokens=budget,
                key=keys[i],
                n=n,
                sampling=sampling,
                images=None if images is None else _prompt_images(images[i]),
            )
        )
        for i, (p, budget) in enumerate(zip(ids, budgets, strict=True))
    ]
    before = dataclasses.asdict(engine.stats)
    engine.run()
    if stats is not None:
        after = dataclasses.asdict(engine.stats)
        stats.update({k: v - before[k] for k, v in after.items() if k != "peak_blocks"})
        stats["peak_blocks"] = after["peak_blocks"]
    return [[_completion(tokenizer, engine, req, j, stop) for j in range(n)] for req in requests]


def _prompt_images(images: Sequence[np.ndarray]) -> np.ndarray:
    """One prompt's images `[I, H, W, C]` (float32)."""
    return np.asarray(images, np.float32).reshape(len(images), *np.shape(images)[1:])


def _completion(tokenizer, engine: Engine, req: Request, j: int, stop) -> Completion:
    """Sample j of `req`, with its routing (cut where a stop string cut the tokens) if recorded."""
    out = _finish(tokenizer, req.tokens[j], req.logprobs[j], engine.hit_eos(req, j), stop)
    if req.routes[j] is None:
        return out
    routes = req.routes[j][: len(req.prompt) + len(out.token_ids)]
    return dataclasses.replace(out, routed_experts=routes)


def request_completions(tokenizer, engine: Engine, req: Request, stop=()) -> list[Completion]:
    """A finished request's samples as `Completion`s (what `generate_continuous` returns for
    its prompt), each with the weights' version of every token it kept (`versions`)."""
    out = []
    for j in range(req.n):
        c = _completion(tokenizer, engine, req, j, stop)
        out.append(dataclasses.replace(c, versions=tuple(req.versions[j][: len(c.token_ids)])))
    return out


def generate_speculative(
    model: Transformer,
    tokenizer,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    drafter: PromptLookup | DraftModel | MTP,
    n: int = 1,
    slots: int = 0,
    stats: dict | None = None,
    **kwargs,
) -> list[list[Completion]]:
    """`generate` with speculative decoding on the engine: the same completions (token-identical
    when greedy, the same distribution when sampling), fewer forward passes of `model` when
    drafts hit.

    Args:
      model, tokenizer, prompts, max_new_tokens, n: as for `generate_continuous`.
      drafter: `PromptLookup(ngram, k)`, `DraftModel(model, k)` (same vocabulary as `model`)
        or `MTP(module, k)` (the model's multi-token-prediction module, `mtp_from_hf`).
      slots: rows decoded together; 0 = every sample at once (at most 256).
      stats: if given, filled with this call's `EngineStats` counts, among them "rounds"
        (forward passes of `model` after the prefills), "proposed" and "accepted" drafts, plus
        "generated" tokens and "acceptance" (accepted / proposed).
      **kwargs: the other arguments of `generate_continuous` (temperature, top_p, top_k, seed,
        seeds, stop, eos_ids, length_bucket, chunk, the KV pool's settings; not `engine`).

    Returns:
      Per prompt, its n `Completion`s; log-probs are the raw model's (temperature 1, no
      top-k/top-p).

    Raises:
      ValueError: what `generate_continuous` rejects; a drafter that is neither kind, a draft
        model with another vocabulary size.
    """
    check_drafter(drafter, model)
    counts = {}
    out = generate_continuous(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        n=n,
        slots=slots or min(len(prompts) * n, 256),
        drafter=drafter,
        stats=counts,
        **kwargs,
    )
    if stats is not None:
        stats.update(counts)
        stats["generated"] = counts["generated_tokens"]
        stats["acceptance"] = counts["accepted"] / max(counts["proposed"], 1)
    return out
