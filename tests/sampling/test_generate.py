"""generate: HF-exact greedy decoding, cache == full forward, log-probs, sampling statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from posttrain.models import KVCache, ModelConfig, Transformer, forward, from_hf
from posttrain.sampling import Completion, filter_logits, generate
from posttrain.sampling._paged import decode, prefill
from posttrain.testing import save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [100, 101, 102, 103, 104]]

TINY = ModelConfig(
    vocab_size=64,
    embed_dim=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    max_seq_len=64,
    sliding_window=3,
    sliding_window_layers=(1, 2),
    attention="xla",
)


@pytest.fixture(scope="module")
def tiny():
    return Transformer.init(TINY, 0)


class CharTokenizer:
    """A stub tokenizer: id i is the letter chr(97 + i % 26); id 0 is EOS, never in the text."""

    eos_ids = (0,)
    pad_id = 0
    bos_id = None
    adds_bos = False

    def encode(self, text):
        return [ord(c) - 96 for c in text]

    def decode(self, ids):
        return "".join(chr(96 + i % 27) for i in ids if i != 0)


def _hf_greedy(path, prompts, max_new_tokens):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    return [tuple(row[L:].tolist()) for row in out]


@pytest.mark.parametrize(
    "arch",
    [
        "llama3",
        "llama_tied_bias",
        "qwen2_mixed_window",
        "qwen3",
        "mistral",
        "gemma2",
        "gemma3_text",
    ],
)
def test_greedy_matches_hf_generate(arch, tmp_path):
    path = save_tiny_hf_model(arch, str(tmp_path / arch))
    model = from_hf(path, attention="xla")
    ours = generate(model, None, PROMPTS, max_new_tokens=12, length_bucket=4)
    assert [[c.finish_reason for c in row] for row in ours] == [["length"]] * len(PROMPTS)
    assert [row[0].token_ids for row in ours] == _hf_greedy(path, PROMPTS, 12)


@jax.jit
def _step(model, tokens, positions, cache):
    return model(tokens, positions, jnp.ones(tokens.shape, jnp.int32), cache)


def test_cached_decoding_matches_full_forward(tiny):
    model = tiny
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
    full = jax.jit(forward, static_argnums=2)(model.params, tokens, TINY)
    positions = jnp.arange(12)[None].repeat(2, 0)
    logits, cache = _step(model, tokens[:, :5], positions[:, :5], KVCache.init(TINY, 2, 16))
    steps = [logits]
    for t in range(5, 12):  # sliding window 3 on two layers: decoding runs past it
        logits, cache = _step(model, tokens[:, t : t + 1], positions[:, t : t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)
    assert int(cache.index) == 12


def test_logprobs_match_teacher_forcing(tiny):
    model = tiny
    out = generate(model, None, PROMPTS[:2], max_new_tokens=10, temperature=1.0, n=2, seed=3)
    rows = [(p, c) for p, samples in zip(PROMPTS[:2], out, strict=True) for c in samples]
    assert all(len(c.token_ids) == len(c.logprobs) == 10 for _, c in rows)
    # Right-pad to one length: causal attention keeps the padding out of earlier logits.
    width = max(len(p) for p, _ in rows) + 10
    seqs = [p + list(c.token_ids) for p, c in rows]
    tokens = jnp.asarray([s + [0] * (width - len(s)) for s in seqs])
    logp = jax.nn.log_softmax(jax.jit(forward, static_argnums=2)(model.params, tokens, TINY))
    for b, (p, c) in enumerate(rows):
        ref = logp[b, len(p) - 1 + jnp.arange(10), jnp.asarray(c.token_ids)]
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, rtol=0)


def _expected_probs(logits, temperature, top_k, top_p):
    """Reference nucleus/top-k distribution, written independently in numpy."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros_like(z, bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    mass = 0.0
    for i in order:
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += p[i]
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 5, 0.9)]
)
def test_sampling_distribution(temperature, top_k, top_p):
    config = TINY.replace(
        vocab_size=8, num_layers=1, sliding_window=None, sliding_window_layers=None
    )
    model = Transformer.init(config, 0)
    params = dict(model.params, lm_head=model.params["lm_head"] * 60.0)  # spread the logits
    model = Transformer(params, config)
    prompt = [1, 2, 3]
    logits = model(jnp.asarray([prompt]))[0, -1]
    expected = _expected_probs(logits, temperature, top_k, top_p)
    assert (expected > 0.02).sum() >= 2, expected  # a distribution worth testing

    kwargs = dict(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, n=2000)
    (samples,) = generate(model, None, [prompt], **kwargs, seed=0)
    counts = np.bincount([c.token_ids[0] for c in samples], minlength=8)
    assert counts[expected == 0].sum() == 0
    live = expected > 0.001
    stat = scipy.stats.chisquare(
        counts[live], expected[live] / expected[live].sum() * counts[live].sum()
    )
    assert stat.pvalue > 1e-3, (counts, expected)

    again = generate(model, None, [prompt], **kwargs, seed=0)
    other = generate(model, None, [prompt], **kwargs, seed=1)
    assert again[0] == samples
    assert other[0] != samples


def test_filter_logits_greedy_limit():
    logits = jnp.asarray([[0.0, 2.0, 1.0, 2.0]])
    out = filter_logits(logits, temperature=1.0, top_k=1, top_p=1.0)
    assert np.isfinite(out).sum() == 2  # ties with the cut are kept


def test_stop_strings_and_eos():
    model = Transformer.init(TINY.replace(vocab_size=27), 0)
    tok = CharTokenizer()
    (free,) = generate(model, tok, ["abc"], max_new_tokens=12, eos_ids=())
    assert free[0].finish_reason == "length" and len(free[0].token_ids) == 12
    text = free[0].text
    stop = text[3:5]
    (cut,) = generate(model, tok, ["abc"], max_new_tokens=12, stop=[stop, "zzzzz"], eos_ids=())
    c = cut[0]
    assert c.finish_reason == "stop"
    assert c.text == text[: text.find(stop)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    assert len(c.logprobs) == len(c.token_ids)

    eos = free[0].token_ids[4]
    (ended,) = generate(model, tok, ["abc"], max_new_tokens=12, eos_ids=[eos])
    first = free[0].token_ids.index(eos)
    assert ended[0].finish_reason == "stop"
    assert ended[0].token_ids == free[0].token_ids[: first + 1]  # EOS included, nothing after
    assert isinstance(ended[0], Completion)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[]), "prompts must be a non-empty"),
        (dict(prompts=[[1] * 60], max_new_tokens=5), "max_seq_len=64"),
        (dict(n=0), "n .* must be >= 1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
        (
            dict(temperature=float("nan")),
            r"temperature must be a finite number >= 0 \(0 is greedy\), got nan",
        ),
        (
            dict(temperature=float("inf")),
            r"temperature must be a finite number >= 0 \(0 is greedy\), got inf",
        ),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be >= 0"),
        (dict(prompts=["abc"]), "pass a tokenizer"),
        (dict(prompts=[[]]), "prompt 0 is empty"),
        (dict(stop="x"), "stop strings need a tokenizer"),
    ],
)
def test_bad_inputs_raise(kwargs, message, tiny):
    model = tiny
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        generate(model, None, args.pop("prompts"), **args)


def test_host_weights_decode_as_device_weights(tiny):
    """NumPy weights (a checkpoint read to the host) decode to what the same weights on the
    device give."""
    host = Transformer(jax.tree.map(np.asarray, tiny.params), TINY)
    assert isinstance(jax.tree.leaves(host.params)[0], np.ndarray)
    prompts, kwargs = [[5, 6, 7], [3, 4, 5, 6, 7, 8]], dict(max_new_tokens=5, temperature=1.0, n=2)
    assert generate(host, None, prompts, **kwargs) == generate(tiny, None, prompts, **kwargs)


def test_new_params_do_not_recompile(tiny):
    model = tiny
    first = generate(model, None, PROMPTS, max_new_tokens=6, temperature=1.0)
    size = decode._cache_size() + prefill._cache_size()
    fresh = Transformer(jax.tree.map(lambda p: p * 1.5, model.params), TINY)
    second = generate(fresh, None, PROMPTS, max_new_tokens=6, temperature=0.5, top_k=4, top_p=0.9)
    assert decode._cache_size() + prefill._cache_size() == size
    assert first != second


def test_per_prompt_seeds_make_each_prompts_samples_independent_of_its_batch(tiny):
    """With `seeds`, a prompt's samples are the same alone or batched with others, at any row
    (RL across processes samples each process's share of the prompts)."""
    settings = dict(max_new_tokens=6, temperature=1.0, n=3)
    together = generate(tiny, None, PROMPTS, seeds=[11, 12, 13], **settings)
    alone = generate(tiny, None, PROMPTS[2:], seeds=[13], **settings)
    reordered = generate(tiny, None, [PROMPTS[2], PROMPTS[0]], seeds=[13, 11], **settings)
    # Sampled ids are exact; a row's log-probs may differ in the last bits with the batch.
    assert [c.token_ids for c in alone[0]] == [c.token_ids for c in together[2]]
    assert [c.token_ids for c in reordered[0]] == [c.token_ids for c in together[2]]
    assert [c.token_ids for c in reordered[1]] == [c.token_ids for c in together[0]]
    # The n samples of a prompt differ from each other (their own keys), and from a new seed.
    assert len({c.token_ids for c in together[0]}) > 1
    other = generate(tiny, None, PROMPTS[:1], seeds=[99], **settings)
    assert [c.token_ids for c in other[0]] != [c.token_ids for c in together[0]]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        generate(tiny, None, PROMPTS, seeds=[1, 2], **settings)
