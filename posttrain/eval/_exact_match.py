"""Greedy exact-match accuracy by one teacher-forced forward pass.

Greedy decoding emits the argmax token at each step given the tokens before it, so it
reproduces a reference completion exactly iff the argmax at every completion position of the
teacher-forced sequence equals the reference token (end-of-turn token included). Scoring that
takes one batched forward pass instead of a decode loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _encode(tokenizer, prompt_messages, answer: str):
    prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True)
    full, mask = tokenizer.encode_chat([*prompt_messages, {"role": "assistant", "content": answer}])
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template renders the prompt differently inside the full turn")
    return full, mask


def greedy_exact_match(model, tokenizer, records, *, batch_size: int = 64) -> np.ndarray:
    """Per record, whether greedy decoding from its prompt yields exactly its answer.

    Args:
      model: a `Transformer` (or any `model(tokens, positions, segment_ids) -> logits`).
      tokenizer: the `posttrain.data.Tokenizer` the model was trained with.
      records: dicts with `prompt` (chat messages) and `answer` (the reference completion).
      batch_size: rows per forward pass.

    Returns:
      Boolean array, one entry per record.
    """
    encoded = [_encode(tokenizer, r["prompt"], r["answer"]) for r in records]
    length = max(len(ids) for ids, _ in encoded)
    forward = jax.jit(lambda m, t, s: jnp.argmax(m(t, segment_ids_BL=s), axis=-1))
    hits = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        tokens = np.zeros((batch_size, length), np.int32)
        segments = np.zeros((batch_size, length), np.int32)
        for row, (ids, _) in enumerate(chunk):
            tokens[row, : len(ids)] = ids
            segments[row, : len(ids)] = 1
        predicted = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(segments)))
        for row, (ids, mask) in enumerate(chunk):
            # position t predicts token t+1: check every answer token (mask) from its predecessor
            answer_positions = [t for t in range(1, len(ids)) if mask[t]]
            hits.append(all(predicted[row, t - 1] == ids[t] for t in answer_positions))
    return np.asarray(hits, bool)
