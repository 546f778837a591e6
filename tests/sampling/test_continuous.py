"""generate_continuous: per-request budgets, EOS and stop strings as `generate` (the engine's own
tests are in test_engine.py; its throughput in benchmarks/generate_throughput.py)."""

import numpy as np
import pytest

from posttrain.models import Transformer
from posttrain.sampling import EngineConfig, generate_continuous
from tests.sampling.reference import generate_static

from .test_generate import TINY, CharTokenizer

_RS = np.random.RandomState(0)
# Mixed prompt lengths across two length buckets, more requests than slots.
PROMPTS = [_RS.randint(1, 64, size).tolist() for size in (3, 17, 9, 1, 30, 12, 5, 22, 8)]


@pytest.fixture(scope="module")
def windowed():  # sliding windows on two layers: decoding runs past them
    return Transformer.init(TINY, 0)


def test_greedy_matches_generate(windowed):
    model = windowed
    budgets = [12, 5, 20, 1, 16, 7, 20, 3, 10]
    static = generate_static(model, None, PROMPTS, max_new_tokens=20, length_bucket=16)
    # An id the model emits early for some prompts (not as their first token for all).
    firsts = [row[0].token_ids[2] for row in static]
    eos = max(set(firsts), key=firsts.count)
    static = generate_static(
        model, None, PROMPTS, max_new_tokens=20, length_bucket=16, eos_ids=[eos]
    )
    ours = generate_continuous(
        model,
        None,
        PROMPTS,
        max_new_tokens=budgets,
        slots=3,
        chunk=4,
        length_bucket=16,
        eos_ids=[eos],
    )
    reasons = []
    for (s,), (c,), budget in zip(static, ours, budgets, strict=True):
        assert c.token_ids == s.token_ids[:budget]
        np.testing.assert_allclose(c.logprobs, s.logprobs[:budget], atol=1e-4, rtol=0)
        stopped = c.token_ids[-1] == eos
        assert c.finish_reason == ("stop" if stopped else "length")
        reasons.append(c.finish_reason)
    assert "stop" in reasons and "length" in reasons  # both endings exercised


def test_stop_strings_match_generate():
    model = Transformer.init(TINY.replace(vocab_size=27), 0)
    tok = CharTokenizer()
    (free,) = generate_static(model, tok, ["abc"], max_new_tokens=12, eos_ids=())
    stop = free[0].text[3:5]
    kwargs = dict(max_new_tokens=12, stop=[stop], eos_ids=())
    prompts = ["abc", "hello", "abc"]
    a = generate_continuous(model, tok, prompts, slots=2, **kwargs)
    b = generate_static(model, tok, prompts, **kwargs)
    # Two programs (slots vs one batch) sum in different orders: log-probs agree to float32
    # rounding, not bitwise (they differed by 1 ulp of 3.1 with XLA:CPU held to 128-bit vectors).
    fields = lambda out: [[(c.text, c.token_ids, c.finish_reason) for c in row] for row in out]  # noqa: E731
    assert fields(a) == fields(b)
    for row_a, row_b in zip(a, b, strict=True):
        for ca, cb in zip(row_a, row_b, strict=True):
            np.testing.assert_allclose(ca.logprobs, cb.logprobs, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=[4, 4]), "max_new_tokens has 2 entries for 1 prompts"),
        (dict(slots=0), "engine slots must be >= 1"),
        (dict(chunk=0), "engine chunk must be >= 1"),
        (dict(max_new_tokens=[70]), "max_seq_len=64"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_inputs_raise(kwargs, message, windowed):
    args = dict(max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate_continuous(windowed, None, [[1, 2]], **args)


def test_a_fixed_max_len_runs_calls_of_other_prompt_lengths_on_the_same_programs(windowed):
    """What a judge does between RL steps: prompts of other lengths (the same prefill bucket and
    attended blocks) run the same compiled prefill and decode with `max_len` fixed; without it
    each call sizes its block tables to its own longest prompt and compiles again. A prompt
    past max_len is refused."""
    from posttrain.sampling._paged import decode, prefill

    def compiled():
        return decode._cache_size() + prefill._cache_size()

    kwargs = dict(max_new_tokens=6, config=EngineConfig(slots=4, chunk=8, block_size=4))
    short, long = [[5, 6, 7, 8, 9, 10], [8, 9]], [[5, 6, 7] * 3 + [1], [8, 9, 10]]
    fixed = generate_continuous(windowed, None, short, max_len=64, **kwargs)
    before = compiled()
    generate_continuous(windowed, None, long, max_len=64, **kwargs)
    assert compiled() == before
    assert generate_continuous(windowed, None, short, **kwargs) == fixed  # (same tokens)
    before = compiled()
    generate_continuous(windowed, None, long, **kwargs)  # 16 tokens: 4 blocks a row, not 3
    assert compiled() > before
    with pytest.raises(ValueError, match="more than max_len=12"):
        generate_continuous(windowed, None, long, max_len=12, **kwargs)
