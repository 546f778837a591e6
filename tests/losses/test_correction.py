"""Off-policy corrections (`rollout_correction`) against NumPy versions of their formulas, and
how the RL loss uses them (dropped tokens leave the loss and its normaliser; weights carry no
gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.losses import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    aggregate,
    policy_loss,
    rollout_correction,
)
from tests.tolerance import assert_close

B, L = 6, 9
LENGTHS = np.array([9, 4, 0, 1, 7, 9])
CAP, LOW, HIGH = 2.0, 0.6, 1.5


def _batch(seed=3, spread=0.15):
    rng = np.random.default_rng(seed)
    mask = (np.arange(L)[None, :] < LENGTHS[:, None]).astype(np.float32)
    old = -np.abs(rng.normal(1.0, 1.0, (B, L)))
    # (rows shifted as a whole, so that whole-row ratios leave the bounds too)
    shift_B = np.array([0.0, 0.8, 0.0, 0.3, -0.8, 0.1])
    rollout = old + rng.normal(0.0, spread, (B, L)) + shift_B[:, None]
    logp = old + rng.normal(0.0, 0.2, (B, L))
    adv = rng.normal(0.0, 1.0, B)
    return *(x.astype(np.float32) for x in (logp, old, rollout, adv)), mask


def _np_correction(old, rollout, mask, level, mode):
    """verl's rollout IS / rejection sampling and IcePop, written out row by row."""
    weights, kept = np.zeros_like(old), np.zeros_like(old)
    for i in range(B):
        n = int(mask[i].sum())
        r = np.exp(old[i, :n].astype(np.float64) - rollout[i, :n])
        if level == "sequence":
            r = np.full(n, np.prod(r))
        elif level == "geometric":
            r = np.full(n, np.prod(r) ** (1.0 / max(n, 1)))
        if mode == "truncate":
            weights[i, :n], kept[i, :n] = np.minimum(r, CAP), 1.0
        else:
            inside = (r >= LOW) & (r <= HIGH)
            kept[i, :n] = inside
            weights[i, :n] = np.where(inside, r if mode == "mask" else 1.0, 0.0)
    return weights, kept


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_weights_and_masks_match_numpy(level, mode):
    _, old, rollout, _, mask = _batch()
    out = rollout_correction(
        old, rollout, mask, level=level, mode=mode, cap=CAP, low=LOW, high=HIGH
    )
    want_weights, want_kept = _np_correction(old, rollout, mask, level, mode)
    np.testing.assert_array_equal(out["kept"], want_kept)
    assert_close(out["weights"], want_weights, rtol=1e-5, ulps=8)
    np.testing.assert_array_equal(np.asarray(out["weights"])[mask == 0], 0.0)
    if mode != "truncate":  # the bounds bite on this batch: some dropped, some kept
        assert 0 < want_kept.sum() < mask.sum()
    elif level == "token":
        assert np.any(want_weights == CAP)  # and the cap does


def test_icepop_is_the_token_level_two_sided_mask():
    """IcePop (Ling Team 2025): the gradient is scaled by k = p_train / p_infer where
    alpha <= k <= beta and zeroed outside, on either side."""
    logp, old, rollout, adv, mask = _batch(spread=1.0)
    out = rollout_correction(old, rollout, mask, level="token", mode="mask", low=LOW, high=HIGH)
    k = np.exp(old - rollout)
    valid = mask > 0
    assert np.any(valid & (k < LOW)) and np.any(valid & (k > HIGH))  # both sides are cut
    np.testing.assert_array_equal(out["kept"], valid & (k >= LOW) & (k <= HIGH))

    def total(lp):
        per_token = policy_loss(lp, old, adv, out["kept"], is_weights_BL=out["weights"])
        return per_token["losses"].sum()

    plain = jax.grad(lambda lp: policy_loss(lp, old, adv, mask)["losses"].sum())(logp)
    want = np.where(out["kept"] > 0, np.asarray(plain) * k, 0.0)
    assert_close(jax.grad(total)(jnp.asarray(logp)), want, rtol=1e-5, ulps=8)


def test_dropped_tokens_leave_the_normaliser_and_weights_have_no_gradient():
    logp, old, rollout, adv, mask = _batch()
    out = rollout_correction(
        old, rollout, mask, level="geometric", mode="reject", low=LOW, high=HIGH
    )
    kept = np.asarray(out["kept"])
    rows = kept.any(axis=1)
    assert rows.sum() < (mask.sum(axis=1) > 0).sum()  # whole rows were rejected
    losses = policy_loss(logp, old, adv, kept, is_weights_BL=out["weights"])["losses"]
    numerator, normaliser = aggregate(losses, kept, "token-mean")
    assert float(normaliser) == kept.sum()
    numerator, normaliser = aggregate(losses, kept, "seq-mean-token-mean")
    assert float(normaliser) == rows.sum()

    def total(o, r):
        c = rollout_correction(o, r, mask, level="sequence", mode="mask", low=LOW, high=HIGH)
        return policy_loss(logp, old, adv, mask, is_weights_BL=c["weights"])["losses"].sum()

    for g in jax.grad(total, argnums=(0, 1))(old, rollout):
        np.testing.assert_array_equal(g, 0.0)


def test_garbage_on_padding_and_huge_ratios_stay_finite():
    _, old, rollout, _, mask = _batch()
    old = np.where(mask > 0, old, np.nan)
    rollout = np.where(mask > 0, rollout - 50.0 * (np.arange(L) == 0), np.inf)  # r = e^50
    for level in CORRECTION_LEVELS:
        out = rollout_correction(old, rollout, mask, level=level, cap=CAP)
        for value in out.values():
            assert np.all(np.isfinite(value)) and np.all(np.asarray(value)[mask == 0] == 0)


def test_bad_arguments_raise():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="level"):
        rollout_correction(x, x, x, level="row", cap=2.0)
    with pytest.raises(ValueError, match="cap > 0"):
        rollout_correction(x, x, x)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        rollout_correction(x, x, x, mode="mask", low=1.2, high=2.0)
