"""Speculative decoding on the paged engine (`generate_speculative`): greedy output identical to
`generate`'s with continuous batching and prefix sharing, drafts accepted, sampling unbiased
(chi-square against the exact distribution), raw-model log-probs of sampled tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from posttrain.models import (
    KVCache,
    MTPModule,
    ParamSpec,
    Transformer,
    get_preset,
    lm_logits,
    param_specs,
)
from posttrain.sampling import (
    MTP,
    DraftModel,
    Engine,
    EngineConfig,
    PromptLookup,
    Request,
    SamplingParams,
    generate_speculative,
)
from posttrain.sampling._speculative import _lookup
from tests.sampling.reference import generate_static

from .test_generate import TINY, _expected_probs

# Mixed lengths, a one-token prompt (nothing to prefill) and a repetitive one (lookups hit).
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [9], [1, 2, 3, 4] * 4 + [1, 2]]
NEW = 16


def _init(config, seed):
    """A random model like `Transformer.init`'s, drawn in numpy: compiling an init per config
    took most of this file's time."""
    rs = np.random.RandomState(seed)

    def leaf(spec):
        if spec.init in ("ones", "zeros"):
            return jnp.full(spec.shape, float(spec.init == "ones"), jnp.float32)
        return jnp.asarray(0.02 * rs.standard_normal(spec.shape), jnp.float32)

    specs = param_specs(config)
    return Transformer(
        jax.tree.map(leaf, specs, is_leaf=lambda x: isinstance(x, ParamSpec)), config
    )


def _one_layer(config):
    return config.replace(num_layers=1, sliding_window=None, sliding_window_layers=None)


def _first_layer_mtp(model):
    """An MTP module that reads mostly the next token's embedding (eh_proj = [I; small], enorm
    at the embeddings' scale) through the model's first layer: it predicts t_{i+2} from t_1 ..
    t_{i+1} about as the model's first layer would, so its drafts are often accepted."""
    D, rs = model.config.embed_dim, np.random.RandomState(2)
    params = dict(
        enorm=jnp.full((D,), 0.02),
        hnorm=jnp.ones((D,)),
        eh_proj=jnp.concatenate([jnp.eye(D), 0.005 * jnp.asarray(rs.standard_normal((D, D)))]),
        layers=jax.tree.map(lambda w: w[:1], model.params["layers"]),
        final_norm=model.params["final_norm"],
    )
    return MTPModule(params, model.config)


def _windowed():
    """TINY (sliding windows on two of three layers). Drafters: the target's own first layer as
    a draft model, and an MTP module built from that layer, chained for 2 drafts (both often
    accepted; a random MTP module drafts in the MTP cache test). Prompt lookup: the MLA/MoE
    case here, and a windowed model's greedy output against HF's in test_engine.py."""
    model = _init(TINY, 0)
    first_layer = dict(model.params, layers=jax.tree.map(lambda w: w[:1], model.params["layers"]))
    draft = Transformer(first_layer, _one_layer(TINY))
    return model, [DraftModel(draft, k=3), MTP(_first_layer_mtp(model), k=2)]


@jax.jit
def _model_argmax(model, tokens_T, module=None, previous_TD=None):
    """(hidden states, argmax tokens) of the model, or of the MTP module over (previous, tokens)
    pairs; no cache."""
    if module is None:
        h_1TD = model.hidden_states(tokens_T[None])
    else:
        h_1TD = module(model.params, tokens_T[None], previous_TD[None])
    return h_1TD[0], jnp.argmax(lm_logits(model.params, h_1TD, model.config)[0], -1)


def _replayed_mtp_acceptance(model, module, prompt, generated):
    """Drafts a greedy MTP drafter with k = 2 has accepted over `generated`, replayed round by
    round without a KV cache: in the round that emits the token at position n, d_1 comes from
    the module over the pairs (h_i, t_{i+1}) up to i = n - 1, d_2 from the same with pair n
    replaced by (the module's output at n - 1, d_1); drafts count while they are the model's
    argmax. Only the engine keeps the module's cache in step with the accepted tokens."""
    full = list(prompt) + list(generated)
    full = jnp.asarray(full + [0] * (model.config.max_seq_len - len(full)))  # one compilation
    previous, best = _model_argmax(model, full)
    best = np.asarray(best)
    tokens = jnp.pad(full[1:], (0, 1))  # pair i: (h_i, t_{i+1})
    accepted, at = 0, 0
    while at < len(generated) - 1:  # the row goes on after emitting generated[at]
        n = len(prompt) + at
        g, drafts = _model_argmax(model, tokens, module, previous)
        d1 = int(drafts[n - 1])
        _, drafts = _model_argmax(model, tokens.at[n].set(d1), module, previous.at[n].set(g[n - 1]))
        hits = (d1 == best[n]) + (d1 == best[n] and int(drafts[n]) == best[n + 1])
        accepted += hits
        at += 1 + hits
    return accepted


def _mla_moe():
    """DeepSeek-V3-like tiny model (MLA, MoE, a dense first layer) with a decisive router, so
    float rounding between forwards of different lengths does not flip an expert choice. The
    draft model's side does not depend on the target's architecture: prompt lookup, and a
    random MTP module (an MLA block with experts and its latent cache)."""
    config = get_preset("tiny_mla_moe", attention="xla", max_seq_len=64)
    model = _init(config, 0)
    layers = dict(model.params["layers"])
    layers["moe"] = dict(layers["moe"], router=layers["moe"]["router"] * 50)
    module = MTPModule.init(config, seed=1)
    drafters = [PromptLookup(ngram=3, k=4), MTP(module, k=2)]
    return Transformer(dict(model.params, layers=layers), config), drafters


# MLA/MoE: tests/sampling/test_engine.py checks speculative greedy output on DeepSeek-V3 against
# HF's; here the MLA/MoE variant runs in `make test-slow`.
@pytest.mark.parametrize(
    "build",
    [_windowed, pytest.param(_mla_moe, marks=pytest.mark.slow)],
    ids=["windowed", "mla_moe"],
)
def test_greedy_matches_generate(build):
    """Two samples per prompt share its blocks (4-token blocks: prompts end mid-block, rounds
    write across block ends), 3 rows serve 8 samples (rows refill between chunks)."""
    model, drafters = build()
    settings = dict(max_new_tokens=NEW, length_bucket=8, n=2)
    plain = generate_static(model, None, PROMPTS, **settings)
    # An id some rows emit mid-way: EOS then ends rows at different rounds.
    eos = plain[0][0].token_ids[5]
    plain = generate_static(model, None, PROMPTS, eos_ids=[eos], **settings)
    reasons = {row[0].finish_reason for row in plain}

    acceptance = []
    for drafter in drafters:
        stats = {}
        ours = generate_speculative(
            model,
            None,
            PROMPTS,
            drafter=drafter,
            eos_ids=[eos],
            stats=stats,
            slots=3,
            block_size=4,
            chunk=4,
            **settings,
        )
        for s, c in zip(sum(plain, []), sum(ours, []), strict=True):
            assert c.token_ids == s.token_ids, drafter
            assert c.finish_reason == s.finish_reason
            np.testing.assert_allclose(c.logprobs, s.logprobs, atol=1e-4, rtol=0)
        assert stats["generated"] == sum(len(c.token_ids) for row in plain for c in row)
        assert stats["prefill_tokens"] < stats["prompt_tokens"]  # a group prefilled once
        assert stats["rounds"] <= stats["generated"]
        acceptance.append(stats["acceptance"])
        if isinstance(drafter, MTP):
            assert stats["accepted"] == sum(
                _replayed_mtp_acceptance(model, drafter.module, prompt, c.token_ids)
                for prompt, row in zip(PROMPTS, plain, strict=True)
                for c in row
            )

    assert reasons == {"stop", "length"}  # both endings exercised
    # Prompt lookup hits the repetitive prompt (and greedy loops); drafters built from the
    # target's own first layer agree with it often.
    assert acceptance[0] > 0.05, acceptance
    if build is _windowed:
        assert min(acceptance) > 0.05, acceptance


def test_mtp_cache_holds_the_models_hidden_states_of_each_sample():
    """After sampled speculative decoding with a random MTP module (k = 2), each sample's MTP
    cache holds, at every position i but the last, the keys and values of the pair (the model's
    hidden state h_i, token t_{i+1}), computed here in one pass without the engine. Two samples
    of an 8-token prompt in 4-token blocks: the module writes position 7 (the prompt's last
    full block) in the first round, so that block must be each sample's own."""
    model = _init(TINY, 0)
    module = MTPModule.init(TINY, seed=3)
    config = EngineConfig(slots=2, block_size=4, chunk=4, prefill_bucket=8)
    engine = Engine(model, config, max_len=32, drafter=MTP(module, k=2))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    request = engine.submit(
        Request(prompt, 12, jax.random.key(0), n=2, sampling=SamplingParams(temperature=1.0))
    )
    engine.run()
    assert request.tokens[0][0] != request.tokens[1][0]  # the samples differ from the start
    rows = engine._rows
    for b, generated in enumerate(request.tokens):  # sample j ran in row j
        full = jnp.asarray([prompt + generated])
        cached = int(rows.lengths_B[b]) - 1  # positions 0 .. length - 2 hold settled pairs
        cache = KVCache.init(module.block_config, 1, cached)
        _, cache = module(
            model.params,
            full[:, 1 : cached + 1],
            model.hidden_states(full)[:, :cached],
            cache=cache,
        )
        slots = np.asarray(rows.tables_BM[b])[:, None] * 4 + np.arange(4)
        slots = slots.reshape(-1)[:cached]
        for pool, expected in [(rows.draft_k, cache.k_TBSKH), (rows.draft_v, cache.v_TBSKH)]:
            pool = np.asarray(pool).reshape(1, -1, *pool.shape[3:])
            np.testing.assert_allclose(pool[:, slots], expected[:, 0], atol=1e-5, rtol=0)


def _spread(model):
    """Logits large enough that the distribution has a few likely tokens, not a flat one."""
    params = dict(model.params, lm_head=model.params["lm_head"] * 10.0)
    return Transformer(params, model.config)


def test_sampling_matches_the_models_distribution():
    """The joint distribution of the first two tokens and the marginal of the third (drafts
    accepted, resampled after a rejection, and the bonus token after k acceptances) equals the
    exact one computed from the model's logits, for every drafter (two sampling settings; the
    MTP one at one)."""
    config = _one_layer(TINY).replace(vocab_size=8)
    model = _spread(_init(config, 0))
    draft = _spread(_init(config, 5))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    V, M = config.vocab_size, 6000
    # Every prefix of up to two generated tokens, in one forward: [V*V, len + 2].
    grid = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    logits = model(jnp.asarray([prompt + list(g) for g in grid]))[:, len(prompt) - 1 :]

    mtp = MTP(_first_layer_mtp(model), k=2)
    settings = [(1.0, 0, 1.0), (0.8, 5, 0.9)]
    for drafter in [PromptLookup(ngram=2, k=2), DraftModel(draft, k=2), mtp]:
        # The MTP drafter's q goes through the draft model's code: one setting.
        for temperature, top_k, top_p in settings[:1] if drafter is mtp else settings:
            probs = [
                np.stack([_expected_probs(l, temperature, top_k, top_p) for l in logits[:, i]])
                for i in range(3)
            ]  # p(t_i | prompt, grid row's first i tokens)
            p_first = probs[0][0]
            joint = p_first[grid[:, 0]] * probs[1][np.arange(V * V), grid[:, 1]]
            third = (joint[:, None] * probs[2]).sum(0)

            stats = {}
            (samples,) = generate_speculative(
                model,
                None,
                [prompt],
                max_new_tokens=3,
                drafter=drafter,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                n=M,
                stats=stats,
            )
            assert 0.05 < stats["acceptance"] < 0.95, stats  # both branches of the rule ran
            ids = np.asarray([c.token_ids for c in samples])
            # Log-probs are the raw model's at each prefix (the first token, drafts, residual
            # and bonus draws alike).
            logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
            expected_logprobs = np.stack(
                [
                    logp[0, 0, ids[:, 0]],
                    logp[ids[:, 0] * V, 1, ids[:, 1]],
                    logp[ids[:, 0] * V + ids[:, 1], 2, ids[:, 2]],
                ],
                axis=1,
            )
            logprobs = np.asarray([c.logprobs for c in samples])
            np.testing.assert_allclose(logprobs, expected_logprobs, atol=1e-4, rtol=0)
            for counts, expected in [
                (np.bincount(ids[:, 0] * V + ids[:, 1], minlength=V * V), joint),
                (np.bincount(ids[:, 2], minlength=V), third),
            ]:
                assert counts[expected == 0].sum() == 0
                live = expected > 0.002
                assert live.sum() >= 4, expected  # a distribution worth testing
                stat = scipy.stats.chisquare(
                    counts[live], expected[live] / expected[live].sum() * counts[live].sum()
                )
                assert stat.pvalue > 1e-3, (drafter, temperature, counts, expected * M)


def test_lookup_drafts():
    history = jnp.asarray(
        [
            [-1, -1, 7, 1, 2, 3, 9, 1, 2, 3, 0, 0],  # last 3-gram seen before: what followed
            [-1, 4, 5, 6, 4, 5, 6, 4, 5, 0, 0, 0],  # a loop: continued with its period
            [-1, -1, -1, 8, 3, 2, 3, 0, 0, 0, 0, 0],  # only a 1-gram matches
            [-1, -1, -1, -1, 5, 6, 0, 0, 0, 0, 0, 0],  # no match: repeat the last token
        ]
    )
    drafts = _lookup(history, jnp.asarray([10, 9, 7, 6]), ngram=3, k=4)
    assert drafts.tolist() == [[9, 1, 2, 3], [6, 4, 5, 6], [2, 3, 2, 3], [6, 6, 6, 6]]


def test_bad_drafters_raise():
    model = Transformer({}, TINY)  # the checks read only the config
    with pytest.raises(ValueError, match="k >= 1"):
        PromptLookup(k=0)
    with pytest.raises(ValueError, match="drafter must be"):
        generate_speculative(model, None, [[1]], max_new_tokens=2, drafter="ngram")
    other = Transformer({}, _one_layer(TINY).replace(vocab_size=32))
    with pytest.raises(ValueError, match="vocab_size"):
        generate_speculative(model, None, [[1]], max_new_tokens=2, drafter=DraftModel(other))
