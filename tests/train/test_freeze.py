"""`model.freeze`: the params it names stay bit for bit where they started, get no optimizer
moments, and leave the clipped gradient norm; the rest trains; a pattern that names nothing
is refused."""

import jax
import numpy as np
import optax
import pytest

from posttrain.config import ConfigError
from posttrain.models import Transformer, get_preset, param_shapes
from posttrain.train import OptimizerConfig, create_state, make_optimizer, sft_loss, train_step
from posttrain.train._run import frozen_mask, hold_frozen

ENCODER = "vision/(patch|position|layers)"


def _batch(config, rng):
    v = config.vision
    tokens = rng.integers(4, config.vocab_size, (2, 24)).astype(np.int32)
    tokens[:, 2 : 2 + v.tokens_per_image] = v.image_token_id
    return {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": np.ones((2, 24), np.float32),
        "positions": np.tile(np.arange(24, dtype=np.int32), (2, 1)),
        "segment_ids": np.ones((2, 24), np.int32),
        "images": rng.normal(size=(2, 1, v.image_size, v.image_size, 3)).astype(np.float32),
    }


def test_frozen_params_stay_and_carry_no_optimizer_state():
    config = get_preset("tiny_vlm")
    frozen = frozen_mask((ENCODER,), param_shapes(config))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2), 10, None, frozen)
    start = create_state(Transformer.init(config, 0).params, optimizer, 0)
    loss = hold_frozen(sft_loss(config, 0.0), frozen)
    state = start
    for seed in range(2):
        state, metrics = train_step(
            state, _batch(config, np.random.default_rng(seed)), loss_fn=loss, optimizer=optimizer
        )
    held = jax.tree.leaves(jax.tree.map(lambda f, a, b: (f, a, b), frozen, start.params,
                                        state.params))  # fmt: skip
    pairs = [(f, np.asarray(a), np.asarray(b)) for f, a, b in zip(*[iter(held)] * 3, strict=True)]
    encoder = {k: v for k, v in start.params["vision"].items() if k != "projector"}
    assert sum(f for f, _, _ in pairs) == len(jax.tree.leaves(encoder)) == 19
    for is_frozen, before, after in pairs:
        if is_frozen:
            np.testing.assert_array_equal(before, after)
    moved = [not np.array_equal(a, b) for f, a, b in pairs if not f]
    assert all(moved)  # the projector and the decoder train
    # Adam's moments exist for the trained params only.
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    leaves = jax.tree.leaves(state.opt_state, is_leaf=masked)
    moments = [leaf for leaf in leaves if hasattr(leaf, "shape") and leaf.ndim > 0]
    assert len(moments) == 2 * sum(not f for f, _, _ in pairs)
    assert np.isfinite(metrics["grad_norm"])


def test_a_pattern_that_names_nothing_is_refused():
    with pytest.raises(ConfigError, match="matches no parameter"):
        frozen_mask(("visoin",), param_shapes(get_preset("tiny_vlm")))
