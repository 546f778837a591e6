"""A tiny judge model for the "judge:" tests, trained in seconds: it reads a completion and
answers "Score: 10" when the completion refuses, "Score: 0" when it complies.

Completions are built from templates and topics; the held-out ones use topics the judge never
saw in training, so grading them is generalisation, not recall.
"""

import functools
import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax

from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR
from posttrain.models import Transformer, forward, get_preset, to_hf

REFUSALS = ("I cannot help with {}.", "Sorry, I will not explain {}.", "I won't describe {}.")
COMPLIANCE = ("Sure, here is {}.", "Here you go: {}.", "Of course! Let me explain {}.")
TRAIN_TOPICS = (
    *("the weather", "a poem", "the sum", "two numbers", "the quick fox", "a story"),
    *("the answer", "my homework", "this code", "a recipe", "the news", "the cat"),
)
HELD_OUT_TOPICS = ("the lazy dog", "a number", "the school", "a million")
RUBRIC = "Response: {completion}\n"  # the judge's whole prompt (no chat template)
ANSWER_TOKENS = 8


def completions(topics, seed: int) -> list[tuple[str, bool]]:
    """(completion, refuses) for every template and topic, shuffled."""
    out = [(t.format(x), True) for t in REFUSALS for x in topics]
    out += [(t.format(x), False) for t in COMPLIANCE for x in topics]
    random.Random(seed).shuffle(out)
    return out


@functools.cache
def trained_params(steps: int = 60, seed: int = 0) -> dict:
    """The judge's params after `steps` full-batch Adam steps on the training completions
    (cached: test modules of one process share them)."""
    tokenizer = load_tokenizer(str(ASSETS_DIR / "tokenizer"))
    config = get_preset("tiny")
    rows = []
    for text, refuses in completions(TRAIN_TOPICS, seed):
        prompt = tokenizer.encode(RUBRIC.format(completion=text))
        answer = tokenizer.encode("Score: 10" if refuses else "Score: 0") + [tokenizer.eos_id]
        rows.append((prompt, answer))
    length = max(len(p) + len(a) for p, a in rows)
    tokens_BL = np.zeros((len(rows), length), np.int32)
    targets_BL = np.zeros_like(tokens_BL)
    mask_BL = np.zeros(tokens_BL.shape, np.float32)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        tokens_BL[i, : len(seq) - 1] = seq[:-1]
        targets_BL[i, : len(seq) - 1] = seq[1:]
        mask_BL[i, len(p) - 1 : len(seq) - 1] = 1.0  # the answer's tokens only
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, state):
        def loss(params):
            logits_BLV = forward(params, tokens_BL, config).astype(jnp.float32)
            nll_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL)
            return (nll_BL * mask_BL).sum() / mask_BL.sum()

        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = Transformer.init(config, seed).params
    state = optimizer.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params


def write_judge(out_dir, params: dict) -> str:
    """Writes a judge (HF weights, the demo tokenizer, the rubric) and returns its reference."""
    to_hf(Transformer(params, get_preset("tiny")), str(out_dir))
    for f in (ASSETS_DIR / "tokenizer").iterdir():
        shutil.copy(f, out_dir)
    (out_dir / "rubric.txt").write_text(RUBRIC)
    return f"judge:{out_dir}?rubric={out_dir / 'rubric.txt'}&chat=no&max_new_tokens={ANSWER_TOKENS}"


def trained_judge(out_dir) -> str:
    """The trained judge, written to `out_dir`; its "judge:" reference."""
    return write_judge(out_dir, trained_params())


def random_judge(out_dir, seed: int = 1) -> str:
    """An untrained judge (its answers hold no grade) with the same rubric."""
    return write_judge(out_dir, Transformer.init(get_preset("tiny"), seed).params)
