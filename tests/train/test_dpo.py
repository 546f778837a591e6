"""The DPO loss_fn: reference handling, step-0 identities, filler rows, a short training run."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.data import load_tokenizer, preference_batches
from posttrain.demo import ASSETS_DIR, make_dataset
from posttrain.models import get_preset, init_params
from posttrain.train import (
    OptimizerConfig,
    create_state,
    dpo_loss,
    make_optimizer,
    reference_logps,
    train_step,
)
from tests.tolerance import ulp

CONFIG = get_preset("tiny", attention="xla")
MAX_LEN = 32


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ASSETS_DIR) + "/tokenizer")


def _pairs(records):
    """Demo problems as pairs: the right answer, and a wrong one with a digit appended."""
    return [
        {"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"] + "1"}
        for r in records
    ]


def _batch(tok, n=6, rows=8, seed=0):
    """n pairs in `rows` rows (the rest are empty filler rows)."""
    data = preference_batches(
        _pairs(make_dataset(n, seed)), tok, max_len=MAX_LEN, batch_size=rows, num_epochs=1
    )
    return jax.tree.map(jnp.asarray, next(data))


def _params(seed):
    return init_params(CONFIG, jax.random.key(seed))


def _copy(params):
    """A separate buffer for the reference, so donating the policy never frees it."""
    return jax.tree.map(jnp.copy, params)


def test_precomputed_reference_matches_on_the_fly(tok):
    batch = _batch(tok)
    policy, ref = _params(0), _params(1)
    on_the_fly = dpo_loss(CONFIG, reference="on_the_fly", ref_params=ref)(policy, batch, None)
    batch = {**batch, **jax.jit(reference_logps, static_argnums=1)(ref, CONFIG, batch)}
    precomputed = dpo_loss(CONFIG, reference="precomputed")(policy, batch, None)
    assert float(on_the_fly["num_tokens"]) == 6
    assert abs(float(on_the_fly["rewards/margins_sum"])) > 1e-3  # the models differ
    for name, value in on_the_fly.items():
        # Rewards are differences of summed log-probs (~150): slack in ulps of those sums.
        atol = 8 * ulp(150.0)
        np.testing.assert_allclose(precomputed[name], value, atol=atol, rtol=1e-6, err_msg=name)


def test_reference_gets_no_gradient(tok):
    batch = _batch(tok)
    policy, ref = _params(0), _params(1)

    def loss(ref_params):
        return dpo_loss(CONFIG, ref_params=ref_params)(policy, batch, None)["loss_sum"]

    grads = jax.jit(jax.grad(loss))(ref)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_step_zero_is_log_2_and_no_accuracy(tok):
    batch = _batch(tok)
    params = _params(0)
    # Scored by the same computation, policy == reference gives margins of exactly 0.
    batch = {**batch, **jax.jit(reference_logps, static_argnums=1)(params, CONFIG, batch)}
    sums = jax.jit(dpo_loss(CONFIG, reference="precomputed"))(params, batch, None)
    assert float(sums["num_tokens"]) == 6
    assert float(sums["loss_sum"]) / 6 == pytest.approx(math.log(2), rel=1e-7)
    assert float(sums["accuracy_sum"]) == 0.0  # ties are not wins
    assert float(sums["rewards/margins_sum"]) == 0.0 and float(sums["rewards/chosen_sum"]) == 0.0

    # Inside the train step the policy pass is differentiated and the reference pass is not:
    # XLA may round them differently, by about an ulp of the summed log-probs.
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3), 10)
    state = create_state(params, optimizer, seed=0)
    loss_fn = dpo_loss(CONFIG, ref_params=_copy(params))
    _, metrics = jax.jit(lambda s, b: train_step(s, b, loss_fn=loss_fn, optimizer=optimizer))(
        state, batch
    )
    assert float(metrics["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert abs(float(metrics["rewards/margins"])) < 1e-6
    assert float(metrics["num_tokens"]) == 6
    assert float(metrics["logps/chosen"]) < 0 and float(metrics["grad_norm"]) > 0


def test_filler_rows_do_not_count(tok):
    policy, ref = _params(0), _params(1)
    loss_fn = dpo_loss(CONFIG, ref_params=ref)
    full = loss_fn(policy, _batch(tok, n=6, rows=6), None)
    padded = loss_fn(policy, _batch(tok, n=6, rows=8), None)
    for name, value in full.items():
        atol = 8 * ulp(150.0)
        np.testing.assert_allclose(padded[name], value, atol=atol, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "simpo", "orpo"])
def test_variants_are_finite(tok, loss_type):
    batch = _batch(tok, n=6, rows=8)  # with filler rows, whose log p = 0 breaks log(1 - p)
    reference = "none" if loss_type in ("simpo", "orpo") else "on_the_fly"
    ref = _params(1) if reference == "on_the_fly" else None
    loss_fn = dpo_loss(CONFIG, loss_type=loss_type, reference=reference, ref_params=ref)
    loss_and_grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, batch, None)["loss_sum"]))
    sums, grads = loss_and_grads(_params(0))
    assert np.isfinite(float(sums)) and float(sums) > 0
    assert np.isfinite(float(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="reference="):
        dpo_loss(CONFIG, loss_type="simpo", reference="on_the_fly", ref_params={})
    with pytest.raises(ValueError, match="reference="):
        dpo_loss(CONFIG, loss_type="sigmoid", reference="none")
    with pytest.raises(ValueError, match="ref_params"):
        dpo_loss(CONFIG, reference="on_the_fly")
    with pytest.raises(ValueError, match="ref_params"):
        dpo_loss(CONFIG, reference="precomputed", ref_params={})
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(CONFIG, loss_type="kto")


def test_training_raises_held_out_preference_accuracy(tok):
    """AdamW 1e-3 on 128 demo pairs: held-out accuracy (log-ratio margin > 0) 0 -> >= 0.9."""
    held_out = make_dataset(64, seed=1)
    train = make_dataset(128, seed=0, exclude=held_out)
    data = preference_batches(_pairs(train), tok, max_len=MAX_LEN, batch_size=16, seed=0)
    eval_batch = next(
        preference_batches(
            _pairs(held_out), tok, max_len=MAX_LEN, batch_size=64, shuffle=False, num_epochs=1
        )
    )
    steps = 10
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, schedule="constant"), steps)
    params = _params(0)
    ref = _copy(params)
    state = create_state(params, optimizer, seed=0)

    # The documented on-the-fly pattern: ref_params is a traced argument of the jitted step.
    @jax.jit
    def step(state, ref_params, batch):
        loss_fn = dpo_loss(CONFIG, beta=0.1, ref_params=ref_params)
        return train_step(state, batch, loss_fn=loss_fn, optimizer=optimizer)

    @jax.jit
    def evaluate(params, ref_params, batch):
        sums = dpo_loss(CONFIG, ref_params=ref_params)(params, batch, None)
        return sums["accuracy_sum"] / sums["num_tokens"], sums["loss_sum"] / sums["num_tokens"]

    accuracy, loss = evaluate(state.params, ref, eval_batch)
    assert float(accuracy) == 0.0 and float(loss) == pytest.approx(math.log(2), abs=1e-6)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, ref, next(data))
        losses.append(float(metrics["loss"]))
    accuracy, loss = evaluate(state.params, ref, eval_batch)
    assert float(accuracy) >= 0.9, (float(accuracy), losses)
    assert float(loss) < math.log(2) and losses[-1] < losses[0]


def test_sft_term_adds_the_chosen_per_token_nll(tok):
    batch = _batch(tok, n=6, rows=8)
    policy, ref = _params(0), _params(1)
    plain = dpo_loss(CONFIG, ref_params=ref)(policy, batch, None)
    weighted = dpo_loss(CONFIG, ref_params=ref, sft_weight=0.5)(policy, batch, None)
    # Independently: the policy's summed chosen log-probs over each pair's response length.
    logps = reference_logps(policy, CONFIG, batch)["ref_chosen_logps"][:6]
    lengths = batch["chosen_loss_mask"][:6].sum(axis=1)
    expected = 0.5 * float(jnp.sum(-logps / lengths))
    assert float(weighted["loss_sum"] - plain["loss_sum"]) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="sft_weight"):
        dpo_loss(CONFIG, loss_type="orpo", reference="none", sft_weight=0.1)


def test_per_domain_accuracy_sums(tok):
    records = _pairs(make_dataset(6, 0))
    for i, r in enumerate(records):
        r["domain"] = "a" if i % 3 else "b"
        if i % 2:  # flipped pairs, so that the random policy wins some and loses some
            r["chosen"], r["rejected"] = r["rejected"], r["chosen"]
    data = preference_batches(records, tok, max_len=MAX_LEN, batch_size=8, num_epochs=1)
    batch = jax.tree.map(jnp.asarray, next(data))
    sums = dpo_loss(CONFIG, ref_params=_params(1), domains=data.domains)(_params(0), batch, None)
    assert data.domains == ("a", "b")
    assert float(sums["accuracy/a_count"]) == 4 and float(sums["accuracy/b_count"]) == 2
    total = float(sums["accuracy/a_sum"] + sums["accuracy/b_sum"])
    assert total == float(sums["accuracy_sum"]) and 0 < total < 6  # a real, mixed comparison
