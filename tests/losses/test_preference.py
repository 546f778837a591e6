"""Preference losses against independent NumPy versions of the published / TRL formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import LOSS_TYPES, preference_loss, sequence_logps

B = 16
BETA = 0.1


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _inputs(seed=0):
    """Summed log-probs (float32-representable, so only the arithmetic precision differs)."""
    rng = np.random.default_rng(seed)
    pi_c = -rng.uniform(5.0, 50.0, B)
    pi_r = -rng.uniform(5.0, 50.0, B)
    ref_c = pi_c + rng.normal(0.0, 2.0, B)
    ref_r = pi_r + rng.normal(0.0, 2.0, B)
    len_c = rng.integers(1, 21, B).astype(np.float64)
    len_r = rng.integers(1, 21, B).astype(np.float64)
    logps = (x.astype(np.float32).astype(np.float64) for x in (pi_c, pi_r, ref_c, ref_r))
    return (*logps, len_c, len_r)


def _reference(loss_type, pi_c, pi_r, ref_c=None, ref_r=None, beta=BETA, eps=0.0, gamma=0.0):
    """(losses, chosen_rewards, rejected_rewards) written from the papers / TRL trainers."""
    if loss_type == "simpo":  # TRL CPOTrainer.cpo_loss, loss_type="simpo"
        logits = (pi_c - pi_r) - gamma / beta
        losses = -_log_sigmoid(beta * logits) * (1 - eps) - _log_sigmoid(-beta * logits) * eps
        return losses, beta * pi_c, beta * pi_r
    if loss_type == "orpo":  # TRL ORPOTrainer.odds_ratio_loss
        log_odds = (pi_c - pi_r) - (np.log1p(-np.exp(pi_c)) - np.log1p(-np.exp(pi_r)))
        return -beta * _log_sigmoid(log_odds), beta * pi_c, beta * pi_r
    logits = (pi_c - pi_r) - (ref_c - ref_r)  # TRL DPOTrainer.dpo_loss
    chosen_logratios, rejected_logratios = pi_c - ref_c, pi_r - ref_r
    if loss_type == "sigmoid":
        losses = -_log_sigmoid(beta * logits) * (1 - eps) - _log_sigmoid(-beta * logits) * eps
    elif loss_type == "robust":
        losses = (-_log_sigmoid(beta * logits) * (1 - eps) + _log_sigmoid(-beta * logits) * eps) / (
            1 - 2 * eps
        )
    elif loss_type == "hinge":
        losses = np.maximum(0.0, 1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    elif loss_type == "sppo_hard":
        losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    elif loss_type == "nca_pair":
        chosen_r, rejected_r = beta * chosen_logratios, beta * rejected_logratios
        losses = (
            -_log_sigmoid(chosen_r)
            - 0.5 * _log_sigmoid(-chosen_r)
            - 0.5 * _log_sigmoid(-rejected_r)
        )
    else:
        raise AssertionError(loss_type)
    return losses, beta * chosen_logratios, beta * rejected_logratios


CASES = [
    ("sigmoid", {}),
    ("sigmoid", {"label_smoothing": 0.1}),
    ("ipo", {}),
    ("ipo", {"lengths": True}),
    ("hinge", {}),
    ("robust", {}),
    ("robust", {"label_smoothing": 0.2}),
    ("sppo_hard", {}),
    ("nca_pair", {}),
    ("simpo", {"lengths": True}),
    ("simpo", {"lengths": True, "gamma": 0.5, "label_smoothing": 0.1}),
    ("simpo", {"gamma": 0.3}),
    ("orpo", {"lengths": True}),
    ("orpo", {}),
]


@pytest.mark.parametrize("loss_type,options", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_matches_numpy_reference(loss_type, options, beta):
    pi_c, pi_r, ref_c, ref_r, len_c, len_r = _inputs()
    eps, gamma = options.get("label_smoothing", 0.0), options.get("gamma", 0.0)
    if not options.get("lengths") and loss_type in ("simpo", "orpo"):
        pi_c, pi_r = pi_c / 32.0, pi_r / 32.0  # stand-in for averaged log-probs; exact in float32
    kwargs = {"loss_type": loss_type, "beta": beta, "label_smoothing": eps, "gamma": gamma}
    args = (pi_c, pi_r) if loss_type in ("simpo", "orpo") else (pi_c, pi_r, ref_c, ref_r)
    np_args = args
    if options.get("lengths"):
        kwargs.update(chosen_lengths_B=jnp.asarray(len_c), rejected_lengths_B=jnp.asarray(len_r))
        lengths = (len_c, len_r) * 2
        # TRL's average_log_prob: every log-prob, policy and reference, over its length.
        np_args = tuple(x / n for x, n in zip(args, lengths[: len(args)], strict=True))
    out = preference_loss(*(jnp.asarray(x, jnp.float32) for x in args), **kwargs)
    losses, chosen, rejected = _reference(loss_type, *np_args, beta=beta, eps=eps, gamma=gamma)
    tol = {"rtol": 1e-6, "atol": 1e-5}
    np.testing.assert_allclose(out["losses"], losses, **tol)
    np.testing.assert_allclose(out["rewards/chosen"], chosen, **tol)
    np.testing.assert_allclose(out["rewards/rejected"], rejected, **tol)
    np.testing.assert_allclose(out["rewards/margins"], chosen - rejected, **tol)
    for key in ("losses", "rewards/chosen", "rewards/margins", "rewards/accuracies"):
        assert out[key].shape == (B,) and out[key].dtype == jnp.float32


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_gradient_matches_finite_differences(label_smoothing):
    pi_c, pi_r, ref_c, ref_r, _, _ = _inputs(seed=1)

    def np_loss(pc, pr):
        return _reference("sigmoid", pc, pr, ref_c, ref_r, eps=label_smoothing)[0].sum()

    h, steps = 1e-6, np.eye(B)
    fd_c = np.array([np_loss(pi_c + h * e, pi_r) - np_loss(pi_c - h * e, pi_r) for e in steps])
    fd_r = np.array([np_loss(pi_c, pi_r + h * e) - np_loss(pi_c, pi_r - h * e) for e in steps])
    fd_c, fd_r = fd_c / (2 * h), fd_r / (2 * h)

    def loss(pc, pr):
        out = preference_loss(
            pc, pr, ref_c, ref_r, loss_type="sigmoid", label_smoothing=label_smoothing
        )
        return out["losses"].sum()

    with jax.enable_x64(True):
        g_c, g_r = jax.grad(loss, argnums=(0, 1))(jnp.asarray(pi_c), jnp.asarray(pi_r))
        assert g_c.dtype == jnp.float64
        g_c, g_r = np.asarray(g_c), np.asarray(g_r)  # keep float64 outside the context
    assert not jax.config.jax_enable_x64
    np.testing.assert_allclose(g_c, fd_c, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g_r, fd_r, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(g_c, -g_r, rtol=1e-12)  # DPO depends on pi_c - pi_r only
    assert np.all(g_c < 0)  # raising the chosen log-prob lowers the loss


def test_reward_metrics():
    pi_c = jnp.asarray([-1.0, -5.0, -3.0, -2.0])
    pi_r = jnp.asarray([-4.0, -2.0, -3.0, -2.0])
    ref = jnp.asarray([-3.0, -3.0, -3.0, -1.0])
    out = preference_loss(pi_c, pi_r, ref, ref, beta=0.5)
    # Halves and small integers: exact in float32.
    np.testing.assert_array_equal(out["rewards/chosen"], [1.0, -1.0, 0.0, -0.5])
    np.testing.assert_array_equal(out["rewards/rejected"], [-0.5, 0.5, 0.0, -0.5])
    np.testing.assert_array_equal(out["rewards/margins"], [1.5, -1.5, 0.0, 0.0])
    np.testing.assert_array_equal(out["rewards/accuracies"], [1.0, 0.0, 0.0, 0.0])  # ties are 0
    simpo = preference_loss(pi_c, pi_r, loss_type="simpo", beta=2.0)
    np.testing.assert_array_equal(simpo["rewards/chosen"], 2.0 * pi_c)
    np.testing.assert_array_equal(simpo["rewards/accuracies"], [1.0, 0.0, 0.0, 0.0])


def test_rewards_carry_no_gradient():
    pi = jnp.asarray([-2.0, -3.0])
    grad = jax.grad(lambda p: preference_loss(p, pi, pi, pi)["rewards/margins"].sum())(pi)
    np.testing.assert_array_equal(grad, 0.0)


def test_jits_with_static_loss_type():
    pi_c, pi_r, ref_c, ref_r, _, _ = _inputs()
    fn = jax.jit(functools.partial(preference_loss, loss_type="nca_pair", beta=0.3))
    eager = preference_loss(pi_c, pi_r, ref_c, ref_r, loss_type="nca_pair", beta=0.3)
    np.testing.assert_allclose(fn(pi_c, pi_r, ref_c, ref_r)["losses"], eager["losses"], rtol=1e-6)


def test_orpo_stable_near_zero_log_prob():
    pi_c = jnp.asarray([-1e-6, -1e-3, -40.0])
    out = preference_loss(pi_c, jnp.full(3, -2.0), loss_type="orpo")
    grad = jax.grad(
        lambda p: preference_loss(p, jnp.full(3, -2.0), loss_type="orpo")["losses"].sum()
    )(pi_c)
    assert np.all(np.isfinite(out["losses"])) and np.all(np.isfinite(grad))


def test_sequence_logps():
    token_logps = jnp.asarray([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = jnp.asarray([[0, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(sequence_logps(token_logps, mask), [-5.0, 0.0])  # exact
    np.testing.assert_array_equal(sequence_logps(token_logps, mask, average=True), [-2.5, 0.0])


def test_unknown_loss_type_lists_valid_ones():
    with pytest.raises(ValueError, match="valid loss types") as err:
        preference_loss(jnp.zeros(2), jnp.zeros(2), loss_type="kto")
    for name in LOSS_TYPES:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "loss_type", ["sigmoid", "ipo", "hinge", "robust", "sppo_hard", "nca_pair"]
)
def test_reference_based_losses_need_references(loss_type):
    x = jnp.zeros(2)
    with pytest.raises(ValueError, match="ref_chosen_logps_B, ref_rejected_logps_B"):
        preference_loss(x, x, loss_type=loss_type)
    with pytest.raises(ValueError, match="pass ref_rejected_logps_B"):
        preference_loss(x, x, x, loss_type=loss_type)


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_refuse_references(loss_type):
    x = -jnp.ones(2)
    preference_loss(x, x, loss_type=loss_type)  # no references needed
    with pytest.raises(ValueError, match="reference-free"):
        preference_loss(x, x, x, x, loss_type=loss_type)


def test_bad_options():
    x = -jnp.ones(2)
    with pytest.raises(ValueError, match="label_smoothing < 0.5"):
        preference_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="apply only to"):
        preference_loss(x, x, x, x, chosen_lengths_B=x, rejected_lengths_B=x)
    with pytest.raises(ValueError, match="both"):
        preference_loss(x, x, loss_type="simpo", chosen_lengths_B=x)
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss(x, x, x, x, beta=0.0)
