"""A run's train step compiled with a flag set, or without it where the compiler refuses
(`posttrain.train._flags`): on a TPU the async collective set, here XLA:CPU options, the real
compiler accepting or refusing them."""

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.train._flags import FlagChosenStep, with_chosen_flags


def _step():
    def step(state, batch):
        return state + jnp.tanh(batch).sum(axis=0), jnp.mean(batch)

    return jax.jit(step, donate_argnums=0)


def test_a_refused_flag_set_falls_back_and_says_why(caplog):
    batch = jnp.arange(12.0).reshape(4, 3) / 7
    expected = _step()(jnp.zeros(3), batch)
    step = FlagChosenStep(_step(), {"xla_no_such_option": "true"}, what="the test set")
    with caplog.at_level("INFO", logger="posttrain"):
        got = step(jnp.zeros(3), batch)
    assert step.flags == (
        "default (the test set failed: INVALID_ARGUMENT: No such compile option: "
        "'xla_no_such_option')"
    )
    assert f"train step compiled with libtpu flags: {step.flags}" in caplog.text
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_accepted_flag_set_compiles_once_per_signature(caplog):
    step = FlagChosenStep(_step(), {"xla_cpu_enable_fast_math": False}, label="test flags")
    with caplog.at_level("INFO", logger="posttrain"):
        state = jnp.zeros(3)
        for i in range(3):
            state, _ = step(state, jnp.full((4, 3), float(i)))
        step(jnp.zeros(3), jnp.ones((2, 3)))  # another batch shape: compiled again
    assert step.flags == "test flags"
    assert caplog.text.count("train step compiled with libtpu flags: test flags") == 2
    np.testing.assert_allclose(state, 4 * (np.tanh(1.0) + np.tanh(2.0)), rtol=1e-6)


def test_off_tpu_a_run_keeps_the_plain_jitted_step():
    jitted = _step()
    assert jax.default_backend() != "tpu" and with_chosen_flags(jitted) is jitted
