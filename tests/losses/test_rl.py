"""RL losses against independent NumPy versions written from the papers' formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import (
    ADVANTAGE_MODES,
    AGGREGATIONS,
    adaptive_kl_update,
    aggregate,
    entropy_from_logits,
    gae,
    group_advantages,
    kl_estimate,
    policy_loss,
    rollout_correction,
    value_loss,
    whiten,
)
from tests.tolerance import assert_close

B, L, G = 8, 10, 4
# Ragged response lengths: an empty row (padding), a full row, and everything between.
LENGTHS = np.array([3, 10, 0, 1, 7, 5, 10, 2])


def _mask(lengths=LENGTHS, width=L):
    return (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.float32)


def _f32(*arrays):
    """Random draws rounded to float32, so the NumPy references see the same inputs."""
    return tuple(np.asarray(a, np.float32).astype(np.float64) for a in arrays)


def _tokens(seed=0, spread=0.3):
    """Policy, old and rollout log-probs, per-token advantages and a ragged mask."""
    rng = np.random.default_rng(seed)
    old = -np.abs(rng.normal(1.0, 1.0, (B, L)))
    logp = old + rng.normal(0.0, spread, (B, L))
    rollout = old + rng.normal(0.0, spread, (B, L))
    adv = rng.normal(0.0, 1.0, (B, L))
    return (*_f32(logp, old, rollout, adv), _mask())


# --- advantages ----------------------------------------------------------------------------


def _np_group_advantages(rewards, mode, unbiased=True, eps=1e-4):
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), G):
        r = rewards[start : start + G]
        if mode == "grpo":  # Shao et al. 2024, outcome supervision: (r - mean) / std
            a = (r - r.mean()) / (r.std(ddof=1 if unbiased else 0) + eps)
        elif mode == "drgrpo":  # Liu et al. 2025: no std division
            a = r - r.mean()
        elif mode == "rloo":  # Ahmadian et al. 2024: leave-one-out baseline
            a = np.array([r[i] - np.delete(r, i).mean() for i in range(G)])
        else:
            a = r
        out[start : start + G] = a
    return out


@pytest.mark.parametrize("mode", ADVANTAGE_MODES)
@pytest.mark.parametrize("unbiased", [True, False])
def test_group_advantages_match_formulas(mode, unbiased):
    (rewards,) = _f32(np.random.default_rng(1).normal(0.0, 2.0, 4 * G))
    out = jax.jit(lambda r: group_advantages(r, G, mode=mode, unbiased_std=unbiased, std_eps=1e-4))(
        jnp.asarray(rewards, jnp.float32)
    )
    assert out.shape == (4 * G,) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _np_group_advantages(rewards, mode, unbiased), atol=2e-6)


def test_group_advantages_default_is_trl_grpo():
    (rewards,) = _f32(np.random.default_rng(2).uniform(0.0, 1.0, 2 * G))
    np.testing.assert_allclose(
        group_advantages(rewards, G), _np_group_advantages(rewards, "grpo", True), atol=2e-6
    )


@pytest.mark.parametrize("mode", ["grpo", "drgrpo", "rloo"])
def test_all_equal_group_gives_exact_zero(mode):
    # 0.1 is not exact in binary, so a computed mean can differ from it by rounding.
    rewards = np.array([0.1] * G + [1.0, 0.0, 1.0, 1.0] + [7.3] * G, np.float32)
    out = np.asarray(group_advantages(rewards, G, mode=mode))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[:G], 0.0)
    np.testing.assert_array_equal(out[2 * G :], 0.0)
    assert np.all(out[G : 2 * G] != 0.0)


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="groups of group_size=3"):
        group_advantages(jnp.zeros(8), 3)
    with pytest.raises(ValueError, match="Unknown advantage mode"):
        group_advantages(jnp.zeros(8), 4, mode="ppo")
    with pytest.raises(ValueError, match="rloo"):
        group_advantages(jnp.zeros(8), 1, mode="rloo")


def _np_gae_row(rewards, values, gamma, lam):
    """Textbook GAE (Schulman et al. 2016, eq. 16) over one sequence, V after the end = 0."""
    n = len(rewards)
    adv, last = np.zeros(n), 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        last = rewards[t] + gamma * next_value - values[t] + gamma * lam * last
        adv[t] = last
    return adv, adv + values


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_ragged_matches_per_sequence_loop(gamma, lam):
    rng = np.random.default_rng(3)
    rewards, values = _f32(rng.normal(size=(B, L)), rng.normal(size=(B, L)))
    mask = _mask()
    # Garbage beyond each sequence must not leak in.
    rewards_in = np.where(mask > 0, rewards, 1e30).astype(np.float32)
    values_in = np.where(mask > 0, values, np.nan).astype(np.float32)
    adv, ret = jax.jit(lambda r, v, m: gae(r, v, m, gamma=gamma, lam=lam))(
        rewards_in, values_in, mask
    )
    assert adv.shape == ret.shape == (B, L) and adv.dtype == jnp.float32
    for i, n in enumerate(LENGTHS):
        want_adv, want_ret = _np_gae_row(rewards[i, :n], values[i, :n], gamma, lam)
        np.testing.assert_allclose(adv[i, :n], want_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[i, :n], want_ret, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(adv)[mask == 0], 0.0)
    np.testing.assert_array_equal(np.asarray(ret)[mask == 0], 0.0)


def test_gae_skips_masked_tokens_inside_a_sequence():
    """Masked tokens (tool outputs) are transparent: GAE over the valid tokens compacted."""
    rng = np.random.default_rng(4)
    rewards, values = _f32(rng.normal(size=(B, L)), rng.normal(size=(B, L)))
    mask = (rng.uniform(size=(B, L)) < 0.6).astype(np.float32)
    adv, ret = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    for i in range(B):
        keep = mask[i] > 0
        want_adv, want_ret = _np_gae_row(rewards[i, keep], values[i, keep], 0.97, 0.9)
        np.testing.assert_allclose(adv[i, keep], want_adv, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[i, keep], want_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_masked_whiten(shift_mean):
    (x,) = _f32(np.random.default_rng(5).normal(3.0, 2.0, (B, L)))
    mask = _mask()
    valid = x[mask > 0]
    mean, var = valid.mean(), valid.var(ddof=1)  # TRL masked_var(unbiased=True)
    want = (x - mean) / np.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    got = np.asarray(whiten(np.where(mask > 0, x, np.inf), mask, shift_mean=shift_mean))
    np.testing.assert_allclose(got[mask > 0], want[mask > 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[mask == 0], 0.0)
    if shift_mean:
        np.testing.assert_allclose(got[mask > 0].mean(), 0.0, atol=1e-5)
        np.testing.assert_allclose(got[mask > 0].std(ddof=1), 1.0, rtol=1e-5)


# --- policy loss ---------------------------------------------------------------------------


def _np_policy_loss(
    logp, old, adv, mask, clip_low, clip_high, dual=None, rollout=None, cap=None, sequence=False
):
    """PPO-clip (Schulman 2017) with DAPO's asymmetric range, verl's dual clip, GSPO and TIS."""
    adv = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    if sequence:  # GSPO eq. 7: s_i = exp(mean_t log(pi / pi_old))
        n = np.maximum(mask.sum(-1), 1)
        ratio = np.broadcast_to(np.exp(((logp - old) * mask).sum(-1) / n)[:, None], logp.shape)
    else:
        ratio = np.exp(logp - old)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_low, 1 + clip_high))
    if dual is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual * adv), loss)
    if rollout is not None:
        loss = loss * np.minimum(np.exp(old - rollout), cap)
    return loss * mask, ratio


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize(
    "clip_low,clip_high,dual", [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]
)
@pytest.mark.parametrize("per_sequence_adv", [False, True])
def test_policy_loss_matches_formula(sequence, clip_low, clip_high, dual, per_sequence_adv):
    logp, old, _, adv, mask = _tokens(seed=6, spread=0.4)
    if per_sequence_adv:
        adv = adv[:, 0]
    want, ratio = _np_policy_loss(
        logp, old, adv, mask, clip_low, clip_high or clip_low, dual, sequence=sequence
    )
    fn = jax.jit(
        lambda lp, o, a, m: policy_loss(
            lp,
            o,
            a,
            m,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual,
            ratio="sequence" if sequence else "token",
        )
    )
    out = fn(logp, old, adv, mask)
    np.testing.assert_allclose(out["losses"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["ratio"], ratio * mask, rtol=1e-5)
    for key, value in out.items():
        assert value.shape == (B, L) and value.dtype == jnp.float32, key
        np.testing.assert_array_equal(np.asarray(value)[mask == 0], 0.0, err_msg=key)
    # Clipped tokens are those whose clipped branch is the larger (verl's pg_clipfrac).
    adv_BL = np.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, logp.shape)
    clipped = -adv_BL * np.clip(ratio, 1 - clip_low, 1 + (clip_high or clip_low)) > -adv_BL * ratio
    np.testing.assert_array_equal(out["clipped"], clipped * mask)
    assert 0 < float(np.sum(out["clipped"])) < mask.sum()
    if not sequence and dual is None:  # d/dlogp of -A w is -A w, and 0 where clipped
        grad = jax.grad(lambda lp: fn(lp, old, adv, mask)["losses"].sum())(logp)
        want_grad = np.where(clipped, 0.0, -adv_BL * ratio) * mask
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_gspo_ratio_is_exp_mean_log_ratio():
    logp, old, _, adv, mask = _tokens(seed=7)
    out = policy_loss(logp, old, adv[:, 0], mask, clip_low=3e-4, clip_high=4e-4, ratio="sequence")
    for i, n in enumerate(LENGTHS):
        s = np.exp(np.mean(logp[i, :n] - old[i, :n])) if n else 1.0
        np.testing.assert_allclose(out["ratio"][i, :n], s, rtol=1e-5)


def test_gspo_gradient_matches_sequence_objective_finite_differences():
    """GSPO-token's gradient equals that of GSPO's sequence objective (Zheng et al. eq. 5, 14)."""
    rng = np.random.default_rng(8)
    logp, old, _, _, mask = _tokens(seed=8)
    # Per-row mean log-ratios chosen away from the clip edges (1 +- 0.1), some clipped.
    log_s = np.array([0.05, -0.3, 0.0, 0.4, -0.05, 0.2, -0.2, 0.02])
    noise = rng.normal(0.0, 0.2, (B, L)) * mask
    noise -= (noise.sum(-1) / np.maximum(mask.sum(-1), 1))[:, None] * mask
    (logp,) = _f32(old + (log_s[:, None] + noise) * mask)
    (adv,) = _f32(np.array([1.0, -1.5, 2.0, 0.5, -0.7, -1.0, 1.2, -0.4]))
    clip = 0.1

    def np_objective(lp):
        n = mask.sum(-1)
        s = np.exp(((lp - old) * mask).sum(-1) / np.maximum(n, 1))
        seq_loss = -np.minimum(s * adv, np.clip(s, 1 - clip, 1 + clip) * adv)
        return seq_loss[n > 0].mean()

    h, fd = 1e-6, np.zeros_like(logp)
    for i, t in zip(*np.nonzero(mask), strict=True):
        step = np.zeros_like(logp)
        step[i, t] = h
        fd[i, t] = (np_objective(logp + step) - np_objective(logp - step)) / (2 * h)

    def loss(lp):
        per_token = policy_loss(lp, old, adv, mask, clip_low=clip, ratio="sequence")["losses"]
        numerator, denominator = aggregate(per_token, mask, "seq-mean-token-mean")
        return numerator / denominator

    with jax.enable_x64(True):
        np.testing.assert_allclose(loss(jnp.asarray(logp)), np_objective(logp), rtol=1e-12)
        grad = np.asarray(jax.grad(loss)(jnp.asarray(logp)))
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    assert np.any(grad[1] == 0) and np.all(grad[0, : LENGTHS[0]] != 0)  # clipped vs not


def test_dual_clip_only_bites_on_negative_advantages():
    ratio = np.array([0.2, 0.9, 1.0, 1.5, 5.0, 50.0])
    logp = np.log(np.concatenate([ratio, ratio]))[None, :]
    old = np.zeros_like(logp)
    adv = np.concatenate([np.full(6, 1.0), np.full(6, -2.0)])[None, :]
    mask = np.ones_like(logp)
    plain = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    dual = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    pos, neg = slice(0, 6), slice(6, 12)
    np.testing.assert_array_equal(dual["losses"][0, pos], plain["losses"][0, pos])
    # -A * clip(w) with A = -2 is 2 w beyond 1.28, capped at 3 * 2 = 6.
    want_neg = np.minimum(2 * np.maximum(ratio, 0.8), 6.0)
    np.testing.assert_allclose(dual["losses"][0, neg], want_neg, rtol=1e-6)
    np.testing.assert_array_equal(dual["dual_clipped"][0], [0] * 6 + [0, 0, 0, 0, 1, 1])
    # The capped tokens carry no gradient, the others the plain one.
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, dual_clip=3.0)["losses"].sum())
    np.testing.assert_array_equal(grad(jnp.asarray(logp, jnp.float32))[0, 10:], 0.0)


def test_importance_weights_scale_each_token_and_stop_gradient():
    logp, old, rollout, adv, mask = _tokens(seed=9, spread=1.0)
    weights = np.minimum(np.exp(old - rollout), 2.0) * mask  # (token TIS)
    want, _ = _np_policy_loss(logp, old, adv, mask, 0.2, 0.2, rollout=rollout, cap=2.0)
    out = policy_loss(logp, old, adv, mask, is_weights_BL=weights)
    np.testing.assert_allclose(out["losses"], want, rtol=1e-5, atol=1e-6)

    def total(lp, w):
        return policy_loss(lp, old, adv, mask, is_weights_BL=w)["losses"].sum()

    g_logp, g_weights = jax.grad(total, argnums=(0, 1))(logp, weights)
    np.testing.assert_array_equal(g_weights, 0.0)
    plain = jax.grad(lambda lp: policy_loss(lp, old, adv, mask)["losses"].sum())(logp)
    assert_close(g_logp, plain * weights, rtol=1e-5, ulps=4)


def test_policy_loss_errors():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="Unknown ratio"):
        policy_loss(x, x, x, x, ratio="seq")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low < 1"):
        policy_loss(x, x, x, x, clip_low=1.0)


# --- aggregation ---------------------------------------------------------------------------


def _np_aggregate(loss, mask, mode, max_len):
    rows = [(loss[i] * mask[i]).sum() for i in range(len(loss))]
    counts = mask.sum(-1)
    if mode == "token-mean":  # DAPO eq. 8: 1 / sum |o_i| * sum_i sum_t
        return sum(rows) / counts.sum()
    nonempty = counts > 0
    if mode == "seq-mean-token-mean":  # GRPO eq. 3: 1/G sum_i 1/|o_i| sum_t
        return np.mean([r / c for r, c in zip(rows, counts, strict=True) if c > 0])
    return np.mean(np.asarray(rows)[nonempty] / max_len)  # Dr.GRPO: sum_t / MAX_TOKENS


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_matches_formula_and_chunks_add_up(mode):
    (loss,) = _f32(np.random.default_rng(10).normal(size=(B, L)))
    mask, max_len = _mask(), 16
    want = _np_aggregate(loss, mask, mode, max_len)
    fn = jax.jit(lambda x, m: aggregate(x, m, mode, max_len=max_len))
    numerator, denominator = fn(loss, mask)
    assert numerator.dtype == denominator.dtype == jnp.float32
    np.testing.assert_allclose(numerator / denominator, want, rtol=1e-6)
    want_denominator = mask.sum() if mode == "token-mean" else np.sum(LENGTHS > 0)
    assert float(denominator) == want_denominator
    for chunks in (2, 4):
        pieces = zip(np.split(loss, chunks), np.split(mask, chunks), strict=True)
        parts = [fn(x, m) for x, m in pieces]
        total_num = sum(float(n) for n, _ in parts)
        total_den = sum(float(d) for _, d in parts)
        np.testing.assert_allclose(total_num, numerator, rtol=1e-6)
        assert total_den == float(denominator)
        np.testing.assert_allclose(total_num / total_den, want, rtol=1e-6)


def test_aggregate_errors():
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="max_len > 0"):
        aggregate(x, x, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="Unknown aggregation"):
        aggregate(x, x, "mean")


# --- KL, value loss, entropy ---------------------------------------------------------------


def test_kl_estimators_match_formulas_and_expectations():
    logp, ref, _, _, mask = _tokens(seed=11, spread=0.5)
    log_r = ref - logp  # Schulman's r = q / p with x ~ p = the policy
    want = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}
    for kind, value in want.items():
        np.testing.assert_allclose(kl_estimate(logp, ref, kind), value, rtol=1e-5, atol=1e-6)
        masked = kl_estimate(np.where(mask > 0, logp, -np.inf), ref, kind, mask_BL=mask)
        np.testing.assert_allclose(masked, value * mask, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(kl_estimate(logp, ref, "k3")) >= 0)
    # Over a whole vocabulary, E_p[k1] = E_p[k3] = KL(p || q) exactly.
    rng = np.random.default_rng(12)
    p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    kl = np.sum(p * np.log(p / q))
    for kind in ("k1", "k3"):
        estimate = np.asarray(kl_estimate(np.log(p)[None], np.log(q)[None], kind), np.float64)
        np.testing.assert_allclose(np.sum(p * estimate), kl, rtol=1e-5)
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        kl_estimate(logp, ref, "k4")


@pytest.mark.parametrize("observed", [0.0, 0.05, 0.1, 0.11, 0.5, 3.0])
def test_adaptive_kl_update_matches_ziegler(observed):
    coef, target, horizon, n_steps = 0.2, 0.1, 10000, 256
    error = np.clip(observed / target - 1, -0.2, 0.2)  # Ziegler et al. 2019, section 2.2
    want = coef * (1 + error * n_steps / horizon)
    got = jax.jit(
        lambda c, k: adaptive_kl_update(c, k, target=target, horizon=horizon, n_steps=n_steps)
    )(coef, observed)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (got > coef) == (observed > target) or observed == target


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_ppo(clip):
    rng = np.random.default_rng(13)
    values, old, returns = _f32(*rng.normal(size=(3, B, L)))
    mask = _mask()
    if clip is None:
        want = 0.5 * (values - returns) ** 2
    else:
        clipped = np.clip(values, old - clip, old + clip)
        want = 0.5 * np.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    out = value_loss(values, old, returns, mask, clip=clip)
    np.testing.assert_allclose(out["losses"], want * mask, rtol=1e-5, atol=1e-6)
    if clip is not None:
        assert 0 < float(out["clipped"].sum()) < mask.sum()


def test_entropy_from_logits():
    rng = np.random.default_rng(14)
    logits = rng.normal(0.0, 3.0, (2, 3, 7)).astype(np.float32)
    logits[0, 0] += 1e4  # large but equal offsets must not overflow
    logits[1, 1, :3] = -np.inf  # top-k masked vocabulary entries
    x = logits.astype(np.float64)
    log_p = x - np.max(x, -1, keepdims=True)
    log_p = log_p - np.log(np.sum(np.exp(log_p), -1, keepdims=True))
    p = np.exp(log_p)
    want = -np.sum(p * np.where(p > 0, log_p, 0.0), -1)
    out = entropy_from_logits(jnp.asarray(logits))
    assert out.shape == (2, 3) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda z: entropy_from_logits(z).sum())(jnp.asarray(logits))
    assert np.all(np.isfinite(grad))
    assert entropy_from_logits(jnp.asarray(logits, jnp.bfloat16)).dtype == jnp.float32


# --- robustness ----------------------------------------------------------------------------


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_fully_masked_rows_and_garbage_padding_stay_finite(sequence, mode):
    logp, old, rollout, adv, mask = _tokens(seed=15)
    pad = mask == 0
    logp, old = np.where(pad, -np.inf, logp), np.where(pad, np.nan, old)
    rollout = np.where(pad, 1e30, rollout)
    values, returns = np.where(pad, np.inf, adv), np.where(pad, np.nan, adv)

    def loss(lp, v):
        out = policy_loss(
            lp,
            old,
            adv,
            mask,
            ratio="sequence" if sequence else "token",
            dual_clip=3.0,
            is_weights_BL=rollout_correction(old, rollout, mask, cap=2.0)["weights"],
        )
        kl = kl_estimate(lp, old, "k3", mask_BL=mask)
        per_token = out["losses"] + 0.1 * kl + value_loss(v, adv, returns, mask)["losses"]
        numerator, denominator = aggregate(per_token, mask, mode, max_len=L)
        return numerator / denominator, out

    (value, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(logp, values)
    assert np.isfinite(float(value))
    for key, metric in out.items():
        assert np.all(np.isfinite(metric)), key
    for g in grads:
        assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[pad] == 0)
    assert np.all(np.asarray(grads[0])[2] == 0)  # the empty row

    # An all-padding batch: zero numerator and denominator, nothing NaN before the division.
    none = np.zeros_like(mask)
    losses = policy_loss(logp, old, adv, none)["losses"]
    numerator, denominator = aggregate(losses, none, mode, max_len=L)
    assert float(numerator) == 0.0 and float(denominator) == 0.0
    adv_gae, ret = gae(np.where(pad, np.nan, adv), values, mask)
    assert np.all(np.isfinite(adv_gae)) and np.all(np.isfinite(ret))
    assert np.all(np.isfinite(whiten(values, mask))) and np.all(whiten(values, none) == 0)
