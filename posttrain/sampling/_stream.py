"""Token-by-token generation for one prompt, yielding text as it is produced (the CLI's path).

The paged engine with one row and one decode step per call: the same decoder, cache and keys
as `generate` (so a seeded stream is `generate`'s sample for that prompt), with a device round
trip per token, which is what an interactive terminal wants and what batch rollouts avoid.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import numpy as np

from posttrain.models import Transformer
from posttrain.sampling._completion import check_settings
from posttrain.sampling._engine import Engine, Request
from posttrain.sampling._engine_config import EngineConfig
from posttrain.sampling._params import SamplingParams
from posttrain.sampling._speculative import MTP, DraftModel, PromptLookup


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
    kv_dtype: str = "auto",
    drafter: PromptLookup | DraftModel | MTP | None = None,
) -> Iterator[str]:
    """Yields the decoded continuation of `prompt_ids` piece by piece until EOS or the limit;
    `kv_dtype` and `drafter` as for the engine (`EngineConfig`, `Engine`)."""
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    check_settings(max_new_tokens=max_new_tokens, n=1, **settings)
    limit = model.config.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens; with max_new_tokens="
            f"{max_new_tokens} that exceeds the model's context ({limit})"
        )
    engine = Engine(
        model,
        EngineConfig(slots=1, chunk=1, kv_dtype=kv_dtype),
        max_len=len(prompt_ids) + max_new_tokens,
        eos_ids=tokenizer.eos_ids,
        drafter=drafter,
    )
    # Prompt 0 of `generate(..., seed=seed)` draws from fold_in(key(seed), 0).
    key = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 0))
    request = engine.submit(
        Request(
            list(prompt_ids), max_new_tokens, np.asarray(key), sampling=SamplingParams(**settings)
        )
    )
    shown = text = ""
    while not engine.idle:
        engine.step()
        text = tokenizer.decode(request.tokens[0])
        if text != shown and not text.endswith("\ufffd"):  # wait for a character's last byte
            yield text[len(shown) :]
            shown = text
    if text != shown:  # the sample ended inside a character: no more bytes are coming
        yield text[len(shown) :]
