"""Exact match by one teacher-forced pass equals running greedy decoding step by step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR, make_dataset
from posttrain.eval import greedy_exact_match


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class _TableModel:
    """Predicts `table[previous token]`: its greedy decoding is known in advance."""

    table: np.ndarray

    def __call__(self, tokens, positions_BL=None, segment_ids_BL=None):
        return jax.nn.one_hot(jnp.asarray(self.table)[tokens], len(self.table)) * 10.0


def _greedy(model, tokenizer, prompt, max_new):
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    out = []
    for _ in range(max_new):
        token = int(jnp.argmax(model(jnp.asarray([ids + out], jnp.int32))[0, -1]))
        out.append(token)
        if token in tokenizer.eos_ids:
            break
    return out


def test_matches_step_by_step_greedy_decoding():
    tokenizer = load_tokenizer(f"{ASSETS_DIR}/tokenizer")
    records = make_dataset(8, seed=5)
    # a record whose answer has distinct digits first, so the decoding chain has no cycle
    first = next(r for r in records if len(set(r["answer"])) == len(r["answer"]) > 1)
    records.remove(first)
    records.insert(0, first)
    # Wire the table so greedy decoding after the generation prompt spells record 0's answer,
    # then the end-of-turn token; record 1 gets a prefix of that answer (decoding goes on).
    table = (np.arange(512) * 7 + 3) % 512
    prompt = tokenizer.apply_chat_template(records[0]["prompt"], add_generation_prompt=True)
    answer = tokenizer.encode(records[0]["answer"], add_special_tokens=False)
    chain = [prompt[-1], *answer, tokenizer.eos_id]
    for a, b in zip(chain[:-1], chain[1:], strict=True):
        table[a] = b
    records[1]["answer"] = records[0]["answer"][:-1]
    model = _TableModel(table)

    got = greedy_exact_match(model, tokenizer, records, batch_size=3)
    expected = [
        tokenizer.decode(_greedy(model, tokenizer, r["prompt"], 8)) == r["answer"] for r in records
    ]
    assert list(got) == expected
    assert expected[0] and not any(expected[1:])
