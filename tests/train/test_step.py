"""The pure train step: accumulation invariance, token-weighted packing loss, the NaN guard."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from posttrain.models import forward, get_preset, init_params, param_specs
from posttrain.train import (
    OptimizerConfig,
    create_state,
    make_optimizer,
    sft_loss,
    train_step,
)

CONFIG = get_preset("tiny", attention="xla")


def _batch(rows=8, length=16, seed=0):
    """Rows with very different numbers of loss tokens (1 to 15)."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(1, 512, (rows, length)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    loss_mask = np.zeros((rows, length), np.float32)
    for r in range(rows):
        loss_mask[r, length - 1 - (1 + 2 * r) % (length - 1) : length - 1] = 1.0
    return {
        "tokens": tokens,
        "targets": targets,
        "loss_mask": loss_mask,
        "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        "segment_ids": np.ones((rows, length), np.int32),
    }


def _step(micro_batches, optimizer=None):
    optimizer = optimizer or make_optimizer(OptimizerConfig(learning_rate=1e-2, grad_clip=0.0), 10)
    params = init_params(CONFIG, jax.random.key(0))
    state = create_state(params, optimizer, seed=0)
    step = jax.jit(
        functools.partial(
            train_step,
            loss_fn=sft_loss(CONFIG, 0.0),
            optimizer=optimizer,
            micro_batches=micro_batches,
        )
    )
    return state, step


def _recording_sgd():
    """SGD whose state keeps the last gradient it received, so a test can read the update
    exactly (params after minus before would lose digits to float cancellation)."""
    record = optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (updates, updates),
    )
    return optax.chain(record, optax.sgd(1e-3))


def test_accumulation_is_invariant_to_micro_batching():
    """1 x 8 rows and 8 x 1 row give the same update (SGD: the update is the gradient)."""
    batch = _batch()
    assert len({int(m.sum()) for m in batch["loss_mask"]}) > 4  # uneven token counts
    results = {}
    for micro in (1, 8):
        state, step = _step(micro, _recording_sgd())
        new_state, metrics = step(state, batch)
        update = jax.tree.map(np.asarray, new_state.opt_state[0])
        results[micro] = (update, float(metrics["loss"]))
    (update_1, loss_1), (update_8, loss_8) = results[1], results[8]
    assert abs(loss_1 - loss_8) <= 1e-6 * abs(loss_1)
    for a, b in zip(jax.tree.leaves(update_1), jax.tree.leaves(update_8), strict=True):
        assert np.linalg.norm(a - b) <= 1e-6 * np.linalg.norm(a)


def test_loss_is_the_token_mean_not_a_mean_of_means():
    batch = _batch()
    state, step = _step(4)
    _, metrics = step(state, batch)
    logits = np.asarray(
        jax.jit(lambda p: jax.nn.log_softmax(forward(p, batch["tokens"], CONFIG)))(state.params)
    )
    nll = -np.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    expected = (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    assert float(metrics["num_tokens"]) == batch["loss_mask"].sum()


def test_packed_batch_loss_equals_token_weighted_unpacked_loss():
    rng = np.random.RandomState(1)
    docs = [rng.randint(1, 512, n).astype(np.int32) for n in (5, 9, 7)]
    masks = [
        np.r_[np.zeros(n // 2), np.ones(n - n // 2 - 1), 0.0].astype(np.float32) for n in (5, 9, 7)
    ]  # loss on each document's second half, no target at its end
    state, step = _step(1)
    loss_fn = sft_loss(CONFIG, 0.0)

    def row(doc, mask, length=21, segment=1):
        pad = length - len(doc)
        return {
            "tokens": np.r_[doc, np.zeros(pad, np.int32)][None],
            "targets": np.r_[np.roll(doc, -1), np.zeros(pad, np.int32)][None],
            "loss_mask": np.r_[mask, np.zeros(pad, np.float32)][None],
            "positions": np.r_[np.arange(len(doc)), np.zeros(pad)].astype(np.int32)[None],
            "segment_ids": np.r_[np.full(len(doc), segment), np.zeros(pad)].astype(np.int32)[None],
        }

    separate = [
        jax.device_get(loss_fn(state.params, row(d, m), None))
        for d, m in zip(docs, masks, strict=True)
    ]
    expected = sum(s["nll_sum"] for s in separate) / sum(s["num_tokens"] for s in separate)
    packed = {
        "tokens": np.concatenate(docs)[None],
        "targets": np.concatenate([np.roll(d, -1) for d in docs])[None],
        "loss_mask": np.concatenate(masks)[None],
        "positions": np.concatenate([np.arange(len(d)) for d in docs]).astype(np.int32)[None],
        "segment_ids": np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)]).astype(
            np.int32
        )[None],
    }
    _, metrics = step(state, packed)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)


def test_non_finite_step_is_skipped_and_counted():
    batch = _batch()
    state, step = _step(2)
    bad = jax.tree.map(lambda x: x, state.params)
    bad["final_norm"] = bad["final_norm"].at[0].set(jnp.nan)
    state = state.replace(params=bad)
    new_state, metrics = step(state, batch)
    assert int(metrics["bad_step"]) == 1 and int(new_state.bad_steps) == 1
    assert int(new_state.skipped_steps) == 1 and int(new_state.step) == 1
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # update skipped
    for a, b in zip(
        jax.tree.leaves(new_state.opt_state), jax.tree.leaves(state.opt_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_weight_decay_only_on_matrices():
    specs = param_specs(CONFIG)
    mask = jax.tree.map(lambda s: s.init == "normal", specs, is_leaf=lambda x: hasattr(x, "init"))
    config = OptimizerConfig(learning_rate=1e-3, weight_decay=0.5, grad_clip=0.0)
    optimizer = make_optimizer(config, 10, mask)
    params = init_params(CONFIG, jax.random.key(0))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    assert float(jnp.abs(updates["final_norm"]).max()) == 0.0  # norms: no decay
    assert float(jnp.abs(updates["embed"]).max()) > 0.0  # matrices decay (warmup 0 -> lr > 0)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules_warm_up_then_decay(schedule):
    from posttrain.train import learning_rate_schedule

    lr = learning_rate_schedule(
        OptimizerConfig(learning_rate=1.0, warmup_steps=10, schedule=schedule, end_lr_ratio=0.1),
        110,
    )
    assert float(lr(0)) == 0.0 and abs(float(lr(5)) - 0.5) < 1e-6
    assert abs(float(lr(10)) - 1.0) < 1e-6
    final = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
    assert abs(float(lr(110)) - final) < 1e-6


def _least_squares(params, batch, rng):
    del rng
    residual = batch["x"] @ params["w"] - batch["y"]
    return {"loss_sum": jnp.sum(residual**2), "num_tokens": jnp.float32(len(residual))}


def test_passes_step_is_successive_updates_on_strided_minibatches():
    """2 epochs x 2 minibatches = train_step on rows 0::2, 1::2, 0::2, 1::2, in order."""
    from posttrain.train._step import BatchPasses, passes_step

    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(8, 3).astype(np.float32), "y": rng.randn(8).astype(np.float32)}
    adam = optax.adam(0.1)
    state = create_state({"w": jnp.zeros(3)}, adam, seed=0)
    step = jax.jit(functools.partial(train_step, loss_fn=_least_squares, optimizer=adam))
    expected, losses = state, []
    for _ in range(2):
        for mini in ({k: v[i::2] for k, v in batch.items()} for i in range(2)):
            expected, m = step(expected, mini)
            losses.append(float(m["loss"]))
    passes = BatchPasses(epochs=2, minibatches=2)
    new, metrics = jax.jit(
        functools.partial(passes_step, passes=passes, loss_fn=_least_squares, optimizer=adam)
    )(state, batch)
    assert int(new.step) == 4
    np.testing.assert_allclose(new.params["w"], expected.params["w"], rtol=1e-6)
    # The first update's loss (the policy that made the batch) and the last one's.
    np.testing.assert_allclose(metrics["loss"], losses[0], rtol=1e-6)
    np.testing.assert_allclose(metrics["loss_last_update"], losses[-1], rtol=1e-6)
    assert losses[-1] < losses[0]


def test_an_overflowing_learning_rate_skips_the_update():
    adam = optax.adam(float("inf"))
    state = create_state({"w": jnp.ones(3)}, adam, seed=0)
    batch = {"x": np.eye(3, dtype=np.float32), "y": np.zeros(3, np.float32)}
    new, metrics = jax.jit(functools.partial(train_step, loss_fn=_least_squares, optimizer=adam))(
        state, batch
    )
    assert np.isfinite(float(metrics["loss"])) and int(metrics["bad_step"]) == 1  # finite grads
    np.testing.assert_array_equal(new.params["w"], state.params["w"])


def test_an_update_making_non_finite_params_is_skipped():
    # Finite loss, gradients and update; post_update (e.g. the MoE routing bias) makes a NaN.
    sgd = optax.sgd(0.1)
    state = create_state({"w": jnp.ones(3), "b": jnp.zeros(2)}, sgd, seed=0)
    batch = {"x": np.eye(3, dtype=np.float32), "y": np.zeros(3, np.float32)}
    poison = lambda params, sums: {**params, "b": params["b"].at[1].set(jnp.nan)}
    step = jax.jit(
        functools.partial(train_step, loss_fn=_least_squares, optimizer=sgd, post_update=poison)
    )
    new, metrics = step(state, batch)
    assert np.isfinite(float(metrics["grad_norm"])) and int(metrics["bad_step"]) == 1
    for key in ("w", "b"):
        np.testing.assert_array_equal(new.params[key], state.params[key])


def test_bfloat16_first_moment_halves_it_and_follows_the_float32_update():
    """`optimizer.mu_dtype="bfloat16"`: Adam's first moment is stored in bfloat16 (half its
    bytes); the first update, m = (1 - b1) g rounded to bfloat16 then divided by sqrt(v), is the
    float32 update within bfloat16's relative rounding (2^-8)."""
    params = init_params(CONFIG, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01) * jnp.sign(p + 0.5), params)
    updates = {}
    for dtype in ("", "bfloat16"):
        config = OptimizerConfig(learning_rate=1e-2, grad_clip=0.0, mu_dtype=dtype)
        optimizer = make_optimizer(config, 10)
        state = optimizer.init(params)
        mu = state[0][0].mu  # the chain's adamw: (scale_by_adam state, ...)
        assert {leaf.dtype for leaf in jax.tree.leaves(mu)} == {jnp.dtype(dtype or "float32")}
        updates[dtype] = optimizer.update(grads, state, params)[0]
    for a, b in zip(*map(jax.tree.leaves, (updates["bfloat16"], updates[""])), strict=True):
        np.testing.assert_allclose(a, b, rtol=2**-8, atol=0)
    with pytest.raises(ValueError, match="optimizer.mu_dtype='fp8'"):
        OptimizerConfig(mu_dtype="fp8")
