"""Bradley-Terry reward-model loss against an independent NumPy version of TRL's formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import bradley_terry_loss

B = 16


def _reference(r_c, r_r, margin=None, center=0.0):
    """Per-example losses written from TRL `RewardTrainer.compute_loss` (before its mean)."""
    logits = r_c - r_r if margin is None else r_c - r_r - margin
    log_sigmoid = -np.logaddexp(0.0, -logits)
    return -log_sigmoid + center * (r_c + r_r) ** 2


def _inputs(seed=0):
    """Rewards and margins that float32 represents exactly, so only the arithmetic differs."""
    rng = np.random.default_rng(seed)
    r_c, r_r, margin = rng.normal(0.0, 3.0, (3, B))
    return tuple(x.astype(np.float32).astype(np.float64) for x in (r_c, r_r, np.abs(margin)))


@pytest.mark.parametrize("use_margin", [False, True])
@pytest.mark.parametrize("center", [0.0, 0.01, 0.5])
def test_matches_numpy_reference(use_margin, center):
    r_c, r_r, margin = _inputs()
    margin = margin if use_margin else None
    out = bradley_terry_loss(
        jnp.asarray(r_c, jnp.float32),
        jnp.asarray(r_r, jnp.float32),
        margin_B=None if margin is None else jnp.asarray(margin, jnp.float32),
        center_coefficient=center,
    )
    np.testing.assert_allclose(out["losses"], _reference(r_c, r_r, margin, center), rtol=1e-6)
    np.testing.assert_allclose(out["margins"], r_c - r_r, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out["rewards/chosen"], r_c.astype(np.float32))
    np.testing.assert_array_equal(out["rewards/rejected"], r_r.astype(np.float32))
    np.testing.assert_array_equal(out["accuracies"], (r_c > r_r).astype(np.float32))
    for key in ("losses", "accuracies", "margins", "rewards/chosen", "rewards/rejected"):
        assert out[key].shape == (B,) and out[key].dtype == jnp.float32, key


def test_batch_mean_is_trl_loss():
    """TRL averages the log-sigmoid term and adds the coefficient times the mean square."""
    r_c, r_r, margin = _inputs(seed=3)
    trl = -np.mean(-np.logaddexp(0.0, -(r_c - r_r - margin))) + 0.01 * np.mean((r_c + r_r) ** 2)
    out = bradley_terry_loss(r_c, r_r, margin_B=margin, center_coefficient=0.01)
    np.testing.assert_allclose(jnp.mean(out["losses"]), trl, rtol=1e-6)


@pytest.mark.parametrize("use_margin,center", [(False, 0.0), (True, 0.1)])
def test_gradient_matches_finite_differences(use_margin, center):
    r_c, r_r, margin = _inputs(seed=1)
    margin = margin if use_margin else None

    def np_loss(c, r):
        return _reference(c, r, margin, center).sum()

    h, steps = 1e-6, np.eye(B)
    fd_c = np.array([np_loss(r_c + h * e, r_r) - np_loss(r_c - h * e, r_r) for e in steps])
    fd_r = np.array([np_loss(r_c, r_r + h * e) - np_loss(r_c, r_r - h * e) for e in steps])
    fd_c, fd_r = fd_c / (2 * h), fd_r / (2 * h)

    def loss(c, r):
        return bradley_terry_loss(c, r, margin_B=margin, center_coefficient=center)["losses"].sum()

    with jax.enable_x64(True):
        g_c, g_r = jax.grad(loss, argnums=(0, 1))(jnp.asarray(r_c), jnp.asarray(r_r))
        assert g_c.dtype == jnp.float64
        g_c, g_r = np.asarray(g_c), np.asarray(g_r)
    np.testing.assert_allclose(g_c, fd_c, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g_r, fd_r, rtol=1e-6, atol=1e-9)
    if not center:
        np.testing.assert_allclose(g_c, -g_r, rtol=1e-12)  # depends on r_c - r_r only
        assert np.all(g_c < 0)  # raising the chosen reward lowers the loss


def test_extreme_rewards_stay_finite():
    r_c = jnp.asarray([1e4, -1e4, 1e4, -1e4, 0.0])
    r_r = jnp.asarray([-1e4, 1e4, 1e4, -1e4, 0.0])

    def loss(c, r):
        return bradley_terry_loss(c, r, center_coefficient=0.01)["losses"].sum()

    out = bradley_terry_loss(r_c, r_r)
    grads = jax.grad(loss, argnums=(0, 1))(r_c, r_r)
    assert np.all(np.isfinite(out["losses"]))
    assert all(np.all(np.isfinite(g)) for g in grads)
    # -log sig(2e4) underflows to 0, -log sig(-2e4) is the 2e4 it should be, not inf.
    np.testing.assert_allclose(out["losses"][:2], [0.0, 2e4], rtol=1e-6)
    np.testing.assert_allclose(out["losses"][2:], np.log(2.0), rtol=1e-6)


def test_ties_are_not_accurate():
    out = bradley_terry_loss(jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([1.0, 1.0, 4.0]))
    np.testing.assert_array_equal(out["accuracies"], [0.0, 1.0, 0.0])
    np.testing.assert_allclose(out["losses"][0], np.log(2.0), rtol=1e-6)


def test_low_precision_inputs_compute_in_float32():
    r_c = jnp.asarray([0.5, -1.25], jnp.bfloat16)
    out = bradley_terry_loss(r_c, jnp.zeros(2, jnp.bfloat16), margin_B=jnp.ones(2, jnp.float16))
    assert all(v.dtype == jnp.float32 for v in out.values())
    want = _reference(np.array([0.5, -1.25]), 0.0, 1.0)  # float64
    np.testing.assert_allclose(out["losses"], want, rtol=1e-6)


def test_metrics_carry_no_gradient():
    x = jnp.asarray([1.0, -2.0])
    for key in ("margins", "rewards/chosen", "accuracies"):
        grad = jax.grad(lambda c, k=key: bradley_terry_loss(c, -c)[k].sum())(x)
        np.testing.assert_array_equal(grad, 0.0)


def test_jits():
    r_c, r_r, margin = _inputs()
    fn = jax.jit(lambda c, r, m: bradley_terry_loss(c, r, margin_B=m, center_coefficient=0.1))
    eager = bradley_terry_loss(r_c, r_r, margin_B=margin, center_coefficient=0.1)
    np.testing.assert_allclose(fn(r_c, r_r, margin)["losses"], eager["losses"], rtol=1e-6)


@pytest.mark.parametrize("center", [-0.01, float("nan")])
def test_bad_center_coefficient(center):
    with pytest.raises(ValueError, match="center_coefficient must be >= 0"):
        bradley_terry_loss(jnp.zeros(2), jnp.zeros(2), center_coefficient=center)
