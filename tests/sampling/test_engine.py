"""The paged engine: HF-exact greedy decoding (plain and speculative) with continuous batching and
prefix sharing, the static sampler's exact draws, admission bounded by free blocks, and the int8
KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain import models
from posttrain.models import PagedKVCache, Transformer, forward, from_hf, get_preset
from posttrain.sampling import (
    DraftModel,
    Kept,
    PromptLookup,
    generate_continuous,
)
from posttrain.sampling._engine import Engine, EngineConfig, Request
from posttrain.sampling._params import SamplingParams
from posttrain.testing import save_tiny_hf_model
from tests.sampling.reference import generate_static

from .test_generate import TINY, _hf_greedy

_RS = np.random.RandomState(0)
# Lengths on both sides of block boundaries (block_size 4 below); more requests than slots.
PROMPTS = [_RS.randint(1, 64, size).tolist() for size in (3, 4, 9, 1, 13, 8, 5)]


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "deepseek_v3"])
def test_greedy_matches_hf_generate(arch, tmp_path):
    """qwen3 (qk-norm), mistral (window 4, decoding runs past it), DeepSeek-V3 (MLA latent cache,
    MoE): n=2 samples share each prompt's blocks, 3 slots serve 7 prompts, 4-token blocks;
    plain and speculative (prompt lookup; draft models: tests/sampling/test_speculative.py)."""
    path = save_tiny_hf_model(arch, str(tmp_path / arch))
    model = from_hf(path, attention="xla")
    expected = _hf_greedy(path, PROMPTS, 10)
    for drafter in (None, PromptLookup(ngram=2, k=3)):
        stats = {}
        ours = generate_continuous(
            model,
            None,
            PROMPTS,
            max_new_tokens=10,
            n=2,
            slots=3,
            chunk=4,
            block_size=4,
            drafter=drafter,
            stats=stats,
        )
        assert [[c.token_ids for c in row] for row in ours] == [[e, e] for e in expected]
        assert {c.finish_reason for row in ours for c in row} == {"length"}
    assert stats["rounds"] < stats["generated_tokens"], stats  # drafts were accepted


@pytest.fixture(scope="module")
def windowed():
    return Transformer.init(TINY, 0)


def test_sampled_draws_equal_the_static_sampler(windowed):
    """With per-prompt seeds both paths key token k of sample j of prompt i by
    (seed_i, j, k): the engine, sharing prefixes or not, draws exactly what `generate` does
    (whose distribution tests/sampling/test_generate.py checks against the exact softmax)."""
    seeds = [11 * i + 5 for i in range(len(PROMPTS))]
    kwargs = dict(max_new_tokens=9, temperature=1.0, top_p=0.9, n=3, seeds=seeds)
    static = generate_static(windowed, None, PROMPTS, **kwargs)
    for sharing in (True, False):  # without sharing, also without unstacked layers
        config = EngineConfig(slots=4, block_size=4, prefix_sharing=sharing, unstack_layers=sharing)
        engine = Engine(windowed, config, max_len=64)
        ours = generate_continuous(windowed, None, PROMPTS, engine=engine, **kwargs)
        assert [[c.token_ids for c in r] for r in ours] == [
            [c.token_ids for c in r] for r in static
        ]
        for a, b in zip(sum(ours, []), sum(static, []), strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert any(len({c.token_ids for c in row}) > 1 for row in static)  # samples differ


def test_prefix_sharing_and_block_bounded_admission(windowed):
    """A group's prompt is prefilled once and its full blocks are shared; with a pool of only
    12 blocks (one sequence needs 5) rows wait for blocks, not slots, and outputs stay the
    same."""
    prompts = [list(range(1, 15)), list(range(20, 31))]  # 14 and 11 tokens: 3 full blocks, 2
    runs = {}
    for sharing, blocks in ((True, 0), (False, 0), (True, 12)):
        engine = Engine(
            windowed,
            EngineConfig(slots=4, block_size=4, num_blocks=blocks, prefix_sharing=sharing),
            max_len=20,
        )
        out = generate_continuous(
            windowed, None, prompts, max_new_tokens=6, n=4, temperature=1.0, engine=engine
        )
        runs[sharing, blocks] = ([[c.token_ids for c in r] for r in out], engine.stats)
        assert engine.blocks_in_use == 0  # every block returned
    (shared, s), (plain, p), (small, b) = runs[True, 0], runs[False, 0], runs[True, 12]
    assert shared == plain == small
    assert s.prompt_tokens == p.prompt_tokens == p.prefill_tokens == 4 * (14 + 11)
    assert s.prefill_tokens == 14 + 11  # once per group
    # The 11-token group in 4 slots: its leader's 5 blocks + 3 x 3 of its own (past the 2
    # shared full blocks) with sharing; 4 x 5 without.
    assert (s.peak_blocks, p.peak_blocks) == (14, 20)
    assert b.peak_blocks <= 11 and b.prefill_calls > s.prefill_calls


def test_a_group_admitted_in_parts_shares_one_prefill(windowed):
    """n samples on fewer free rows than n: the first admission holds the prompt's full blocks
    and a copy of its last one, and the samples admitted later pass only the prompt's last
    token over them (its next-token logits: one token, counted), so each prompt is prefilled
    once; the sampled tokens are those with a row for every sample (prompt lookup too), the
    last block whole (8 tokens) or partial; every block comes back, also when a request
    waiting for rows is cancelled."""
    prompts = [list(range(1, 15)), list(range(20, 31)), list(range(40, 48))]  # 14, 11, 8
    kwargs = dict(max_new_tokens=6, temperature=1.0, seeds=[1, 2, 3])
    # (slots, n, drafter, samples admitted after their group's first ones, in late groups)
    for slots, n, drafter, late in ((8, 3, None, 1), (4, 5, None, 3),
                                    (8, 3, PromptLookup(ngram=2, k=2), 1)):  # fmt: skip
        runs = {}
        for rows in (slots, len(prompts) * n):
            config = EngineConfig(slots=rows, block_size=4, chunk=2)
            engine = Engine(windowed, config, max_len=40, drafter=drafter)
            out = generate_continuous(windowed, None, prompts, n=n, engine=engine, **kwargs)
            runs[rows] = [[c.token_ids for c in g] for g in out], engine.stats
            assert engine.blocks_in_use == 0
        (parts, stats), (whole, enough) = runs[slots], runs[len(prompts) * n]
        assert parts == whole, (slots, n)
        assert enough.prefill_tokens == 14 + 11 + 8
        assert stats.prefill_tokens == 14 + 11 + 8 + late, stats  # was 8 (or 33) more
    engine = Engine(windowed, EngineConfig(slots=2, block_size=4), max_len=40)
    request = engine.submit(Request(prompts[0], 6, np.asarray(jax.random.key_data(
        jax.random.key(0))), n=3))  # fmt: skip
    engine.step()  # two samples run to their end; the third waits for a row
    assert engine.blocks_in_use == 3 + 1  # the prompt's full blocks and its last one's copy
    engine.cancel(request)
    assert engine.blocks_in_use == 0


def test_a_conversation_continues_on_the_blocks_its_last_turn_kept(windowed):
    """`Request.keep` leaves a finished sample's KV blocks in the pool; a request whose prompt
    extends those tokens (`cached`) prefills only the rest and draws what a cold request of the
    whole history draws (plain, and prompt lookup, whose last sampled token a round leaves
    unwritten); released blocks all come back. A layered int8 pool keeps none (its ring)."""

    def key(seed):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))

    prompt, sampling = list(range(1, 11)), SamplingParams(temperature=1.0)
    for drafter, unwritten in ((None, 0), (PromptLookup(ngram=2, k=2), 1)):
        engine = Engine(windowed, EngineConfig(slots=4, block_size=4, chunk=4), max_len=64,
                        drafter=drafter)  # fmt: skip
        first = engine.submit(Request(prompt, 7, key(0), n=2, sampling=sampling, keep=True))
        engine.run()
        assert [k.length for k in first.kept] == [10 + 7 - unwritten] * 2
        for j in range(2):
            history = prompt + first.tokens[j] + [30, 31, 32]  # the other side's answer
            before = engine.stats.prefill_tokens
            warm = engine.submit(Request(history, 6, key(5 + j), sampling=sampling, keep=True,
                                         cached=first.kept[j]))  # fmt: skip
            engine.run()
            assert engine.stats.prefill_tokens - before == 3 + unwritten
            cold = engine.submit(Request(history, 6, key(5 + j), sampling=sampling))
            engine.run()
            assert warm.tokens == cold.tokens
            np.testing.assert_allclose(warm.logprobs[0], cold.logprobs[0], atol=1e-5, rtol=0)
            engine.release(warm.kept[0])
        assert engine.blocks_in_use == 0
    with pytest.raises(ValueError, match="must be one sample"):
        engine.submit(Request(prompt, 4, key(0), n=2, cached=Kept([1], 3)))
    layered = Engine(windowed, EngineConfig(block_size=4, kv_dtype="int8_layered"), max_len=64)
    done = layered.submit(Request(prompt, 4, key(0), keep=True))
    layered.run()
    assert done.kept == [None] and layered.blocks_in_use == 0


def test_the_prefix_cache_prefills_only_what_a_prompt_adds_and_evicts_under_pressure(windowed):
    """`prefix_cache`: a prompt starting with an earlier prompt's full blocks (a shared system
    prompt) prefills only the rest (counted) and draws what a cold engine draws; in a pool too
    small to keep everything, an unrelated prompt evicts cached blocks no sequence uses (least
    recently used first) and still draws the cold engine's tokens; new weights drop the cache."""

    def key(seed):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))

    system, sampling = list(range(1, 37)), SamplingParams(temperature=1.0)  # 9 blocks of 4
    other = [(7 * i) % 60 + 1 for i in range(40)]  # (the vocabulary is 64 ids)
    prompts = [system + [40, 41, 42, 43], system + [50, 51, 52, 53, 54, 55], other]

    def run(engine, prompt, seed):
        request = engine.submit(Request(prompt, 6, key(seed), n=2, sampling=sampling))
        engine.run()
        return request.tokens, request.logprobs

    cold = Engine(windowed, EngineConfig(slots=2, block_size=4), max_len=64)
    expected = [run(cold, p, i) for i, p in enumerate(prompts)]
    config = EngineConfig(slots=2, block_size=4, prefix_cache=True, num_blocks=17)  # 16 usable
    engine = Engine(windowed, config, max_len=64)
    assert run(engine, prompts[0], 0) == expected[0]
    assert (engine.blocks_in_use, engine.blocks_cached) == (0, 10)  # its 10 full blocks
    before = engine.stats.prefill_tokens
    tokens, logprobs = run(engine, prompts[1], 1)
    assert engine.stats.prefill_tokens - before == 6 and engine.stats.cached_tokens == 36
    assert tokens == expected[1][0]
    np.testing.assert_allclose(logprobs, expected[1][1], atol=1e-5, rtol=0)
    # 12 + 2 blocks with 5 free: 9 of the 11 cached blocks go, then its own 10 are cached.
    assert run(engine, prompts[2], 2) == expected[2]
    assert engine.blocks_cached == 11 - 9 + 10 and engine.blocks_in_use == 0
    engine.model = windowed  # (the same weights, but the engine cannot know)
    assert engine.blocks_cached == 0 and engine.blocks_in_use == 0
    # Admitted in the same round: the second reads the first's blocks in the same prefill.
    together = Engine(windowed, EngineConfig(slots=4, block_size=4, prefix_cache=True), max_len=64)
    requests = [together.submit(Request(p, 6, key(i), n=2, sampling=sampling))
                for i, p in enumerate(prompts[:2])]  # fmt: skip
    together.run()
    assert [r.tokens for r in requests] == [expected[0][0], expected[1][0]]
    assert together.stats.prefill_calls == 1 and together.stats.prefill_tokens == 40 + 6


def test_requests_that_do_not_fit_are_refused(windowed):
    engine = Engine(windowed, EngineConfig(block_size=4), max_len=16)
    with pytest.raises(ValueError, match="does not fit the engine"):
        engine.submit(Request(prompt=[1] * 12, max_new_tokens=5, key=None))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        Engine(windowed, EngineConfig(block_size=4, num_blocks=4), max_len=16)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(ValueError, match="int8_layered"):
        Engine(windowed, EngineConfig(kv_dtype="int8_layered"), drafter=PromptLookup())
    with pytest.raises(ValueError, match="vocab_size"):
        other = Transformer({}, TINY.replace(vocab_size=32))
        Engine(windowed, EngineConfig(), drafter=DraftModel(other))


def test_int8_cache_memory_and_agreement():
    # Bytes per token: int8 values plus a float16 scale per token and head.
    big = get_preset("llama3_8b")
    for dtype in ("bfloat16", "float32"):
        config = big.replace(compute_dtype=dtype)
        ratio = PagedKVCache.bytes_per_token(config, "int8") / PagedKVCache.bytes_per_token(config)
        assert ratio <= 0.55, (dtype, ratio)
    pool = PagedKVCache.init_pool(TINY, 16, 4, "int8")
    measured = sum(x.nbytes for x in jax.tree.leaves(pool)) / 64
    assert measured == PagedKVCache.bytes_per_token(TINY, "int8")

    # Teacher-forced: logits through a paged cache (written, then read back) vs the plain
    # forward, at every position of random sequences; the int8 caches' argmax agrees.
    same, total = {"int8": 0, "int8_layered": 0}, 0
    for config in (TINY, get_preset("tiny_mla_moe")):
        params = Transformer.init(config, 0).params
        tokens_BL = jax.random.randint(jax.random.key(1), (4, 24), 1, 64)
        reference = jax.jit(forward, static_argnums=2)(params, tokens_BL, config)
        # Row b's 24 tokens in blocks 2 + 6b ... 7 + 6b (4 tokens each), past the scratch block.
        tables_BM = 2 + 6 * jnp.arange(4)[:, None] + jnp.arange(6)
        slots_BL = (tables_BM[:, :, None] * 4 + jnp.arange(4)).reshape(4, 24)
        # (A window past the length giving the plain output: the test below, end to end.)
        for kv_dtype, recent in (("auto", 1), ("int8", 1), ("int8_layered", 8)):
            pool = PagedKVCache.init_pool(config, 26, 4, kv_dtype, ring_rows=4, recent=recent)
            cache = PagedKVCache(
                *pool, slots_BL, tables_BM, jnp.full((4,), 24), ring_rows_B=jnp.arange(4)
            )
            logits, _ = jax.jit(forward, static_argnums=2)(
                params, tokens_BL, config, None, None, cache
            )
            if kv_dtype == "auto":
                np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)
            else:
                same[kv_dtype] += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        total += 4 * 24
    print(f"teacher-forced greedy agreement: { ({k: v / total for k, v in same.items()}) }")
    assert same["int8"] / total >= 0.95 and same["int8_layered"] / total >= 0.95, same


def test_layered_int8_with_a_window_past_the_length_equals_the_plain_cache(windowed):
    """Every token within the window: reads come from the full-precision rings, which prefix
    sharing copies from a prompt's first sample to its others."""
    config = EngineConfig(slots=3, block_size=4, kv_dtype="int8_layered", kv_recent=32)
    ours = generate_continuous(
        windowed, None, PROMPTS, max_new_tokens=10, n=2, engine=Engine(windowed, config, max_len=32)
    )
    static = generate_static(windowed, None, PROMPTS, max_new_tokens=10)
    assert [[c.token_ids for c in r] for r in ours] == [[r[0].token_ids] * 2 for r in static]


@pytest.mark.parametrize("window", [0, 3])
def test_combined_pool_through_the_ragged_kernel_reference(window):
    """The TPU kernel's layout (keys and values interleaved in one pool) and arguments (lengths,
    block tables, query offsets, window), checked eagerly against the kernel's own JAX reference:
    one decode step attends as the XLA gather over separate pools does."""
    config = TINY.replace(sliding_window=None, sliding_window_layers=None)
    rs = np.random.RandomState(window)
    B, K, N, H, b = 3, config.num_kv_heads, config.num_heads, config.head_dim, 4
    lengths = jnp.asarray([5, 9, 2])  # after this step's token is written
    tables = jnp.asarray(rs.permutation(np.arange(1, 13)).reshape(B, 4), jnp.int32)
    slots = (tables[:, :, None] * b + jnp.arange(b)).reshape(B, -1)
    write = jnp.take_along_axis(slots, (lengths - 1)[:, None], axis=1)
    k_old, v_old = (jnp.asarray(rs.randn(13, b, K, H), jnp.float32) for _ in range(2))
    q, k, v = (jnp.asarray(rs.randn(B, 1, n, H), jnp.float32) for n in (N, K, K))

    cache = PagedKVCache(k_old, v_old, write, tables, lengths)
    kv_pos, kv_seg, update, attend = cache.addressing(None, None)
    assert attend is None  # separate pools: the XLA gather
    k_store, k_read = update(k_old, k)
    v_store, v_read = update(v_old, v)
    expected = models.attention(
        q, k_read, v_read, q_positions_BL=(lengths - 1)[:, None], kv_positions_BS=kv_pos,
        q_segment_ids_BL=jnp.ones((B, 1), jnp.int32), kv_segment_ids_BS=kv_seg, window=window,
    )  # fmt: skip

    combined = jnp.stack([k_old, v_old], axis=3).reshape(13, b, 2 * K, H)
    fused = PagedKVCache(combined, None, write, tables, lengths, kernel="ragged_reference")
    store, out = fused.addressing(None, None)[3](combined, q, k, v, window=window, scale=H**-0.5)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(store[:, :, 0::2], k_store)
    np.testing.assert_array_equal(store[:, :, 1::2], v_store)


def test_kept_blocks_never_starve_admission(windowed):
    """More kept samples than the pool holds beside a new request: the oldest kept blocks are
    dropped to admit it (a continuation of a dropped one prefills its whole prompt), and its
    draws are the cold engine's."""

    def key(seed):
        return np.asarray(jax.random.key_data(jax.random.key(seed)))

    sampling, prompt = SamplingParams(temperature=1.0), list(range(1, 11))
    engine = Engine(windowed, EngineConfig(slots=2, block_size=4, num_blocks=13), max_len=32)
    kept = []
    for seed in range(4):  # 4 x 4 blocks kept: more than the 12 usable
        request = engine.submit(Request(prompt, 6, key(seed), sampling=sampling, keep=True))
        engine.run()
        kept += request.kept
    assert not kept[0].blocks and kept[-1].blocks  # the oldest dropped to admit the others
    history = prompt + [5, 6, 7]
    continued = engine.submit(Request(history, 6, key(9), sampling=sampling, cached=kept[0]))
    engine.run()
    cold = Engine(windowed, EngineConfig(slots=2, block_size=4), max_len=32)
    again = cold.submit(Request(history, 6, key(9), sampling=sampling))
    cold.run()
    assert continued.tokens == again.tokens
    for k in kept:
        engine.release(k)
    assert engine.blocks_in_use == 0
