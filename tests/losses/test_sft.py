"""SFT cross-entropy sums against hand computation."""

import jax.numpy as jnp
import numpy as np

from posttrain.losses import cross_entropy_sums, token_log_probs


def test_cross_entropy_sums_by_hand():
    logits = np.log(np.asarray([[[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    targets = np.asarray([[0, 1, 2]])
    mask = np.asarray([[1.0, 1.0, 0.0]])
    sums = cross_entropy_sums(
        jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(mask), z_loss=0.5
    )
    expected_nll = -np.log(0.7) - np.log(0.1)
    np.testing.assert_allclose(sums["nll_sum"], expected_nll, rtol=1e-6)
    np.testing.assert_array_equal(sums["num_tokens"], 2.0)
    np.testing.assert_array_equal(sums["accuracy_sum"], 1.0)  # argmax hits target 0, misses 1
    np.testing.assert_allclose(sums["z_loss_sum"], 0.0, atol=1e-6)  # normalised: log Z = 0
    np.testing.assert_allclose(sums["loss_sum"], expected_nll, rtol=1e-6)


def test_z_loss_counts_log_partition():
    logits = jnp.asarray([[[2.0, 0.0]]])
    sums = cross_entropy_sums(logits, jnp.asarray([[0]]), jnp.ones((1, 1)), z_loss=0.1)
    log_z = np.log(np.exp(2.0) + 1.0)
    np.testing.assert_allclose(sums["z_loss_sum"], log_z**2, rtol=1e-6)
    np.testing.assert_allclose(sums["loss_sum"], (log_z - 2.0) + 0.1 * log_z**2, rtol=1e-6)
    np.testing.assert_allclose(token_log_probs(logits, jnp.asarray([[1]])), -log_z, rtol=1e-6)
