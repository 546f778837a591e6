"""The decoder on its own: packing, scanned compile time, remat, dtypes, presets, config errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import (
    PRESETS,
    ModelConfig,
    Transformer,
    get_preset,
    init_params,
    param_shapes,
)
from posttrain.models._presets import PUBLISHED_PARAMS
from tests.tolerance import ulp

TINY = get_preset("tiny", attention="xla")


@pytest.mark.parametrize(
    "config",
    [TINY, TINY.replace(sliding_window=3, qk_norm=True, qkv_bias=True)],
    ids=["full", "window_qknorm_bias"],
)
def test_packed_documents_match_separate_runs(config):
    model = Transformer.init(config, rng=1)
    rng = np.random.RandomState(0)
    doc_a, doc_b = rng.randint(0, 512, 9), rng.randint(0, 512, 6)
    packed = np.concatenate([doc_a, doc_b, [0]])[None].astype(np.int32)  # one pad at the end
    segments = np.asarray([[1] * 9 + [2] * 6 + [0]], np.int32)
    positions = np.asarray([list(range(9)) + list(range(6)) + [0]], np.int32)
    logits = np.asarray(model(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments)))
    alone_a = np.asarray(model(jnp.asarray(doc_a[None], jnp.int32)))
    alone_b = np.asarray(model(jnp.asarray(doc_b[None], jnp.int32)))
    np.testing.assert_allclose(logits[0, :9], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(logits[0, 9:15], alone_b[0], atol=1e-5)
    # Without segment ids the second document would see the first: the check has teeth.
    leaky = np.asarray(model(jnp.asarray(packed), jnp.asarray(positions)))
    assert np.abs(leaky[0, 9:15] - alone_b[0]).max() > 1e-3


def _compiled_program(num_layers: int) -> str:
    config = TINY.replace(num_layers=num_layers, embed_dim=128, mlp_dim=256, remat="full")
    params = param_shapes(config)
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)

    def loss(params, tokens):
        return Transformer(params, config)(tokens).mean()

    return jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()


def _instructions(hlo: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%?[\w.-]+ = ", hlo, re.M))


def test_compile_time_is_flat_in_depth():
    """Compile time follows the size of the program XLA compiles; the scanned stack keeps
    that size the same at any depth (an unrolled stack would grow 8x from 2 to 16 layers).
    Counted in instructions rather than seconds, which move with the machine's load."""
    shallow, deep = _compiled_program(2), _compiled_program(16)
    print(f"compiled (fwd+bwd): 2 layers {_instructions(shallow)}, 16 layers {_instructions(deep)}")
    assert _instructions(shallow) > 500  # the count sees the program, not a header
    assert " while(" in deep  # the layers stay a loop after XLA's passes, not unrolled
    assert _instructions(deep) <= 1.05 * _instructions(shallow)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch", "offload_dots"])
def test_remat_policies_keep_gradients(remat):
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)), jnp.int32)
    params = init_params(TINY, jax.random.key(0))

    def loss(params, config):
        return jnp.mean(jax.nn.log_softmax(Transformer(params, config)(tokens))[..., 0])

    base = jax.grad(loss)(params, TINY)
    got = jax.grad(loss)(params, TINY.replace(remat=remat))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=8 * ulp(b))  # grads up to ~1.6


def test_bfloat16_compute_tracks_float32():
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 16)), jnp.int32)
    params = init_params(TINY, jax.random.key(0))
    f32 = np.asarray(Transformer(params, TINY)(tokens))
    bf16 = np.asarray(Transformer(params, TINY.replace(compute_dtype="bfloat16"))(tokens))
    assert bf16.dtype == np.float32  # logits are always float32 for the loss
    assert np.abs(f32 - bf16).max() < 0.05


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_presets_shape_check(name):
    config = PRESETS[name]
    shapes = jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert abs(count / PUBLISHED_PARAMS[name] - 1) < 0.01, f"{name}: {count / 1e9:.2f}B params"
    tokens = jax.ShapeDtypeStruct((1, 128), jnp.int32)
    logits = jax.eval_shape(lambda p, t: Transformer(p, config)(t), shapes, tokens)
    assert logits.shape == (1, 128, config.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(attention="flashy"), "attention='flashy'"),
        (dict(remat="some"), "remat='some'"),
        (dict(compute_dtype="float17"), "not a dtype name"),
        (dict(sliding_window=4, sliding_window_layers=(5,)), r"outside 0\.\.1"),
    ],
)
def test_config_errors_say_what_to_change(changes, message):
    with pytest.raises(ValueError, match=message):
        TINY.replace(**changes)


def test_fused_attention_refused_off_its_platform():
    model = Transformer.init(TINY.replace(attention="splash"), rng=0)
    with pytest.raises(ValueError, match="runs on TPU only.*'xla'"):
        model(jnp.zeros((1, 128), jnp.int32))


def test_model_is_a_pytree_with_static_config():
    model = Transformer.init(TINY, rng=0)
    leaves, treedef = jax.tree.flatten(model)
    assert len(leaves) == len(jax.tree.leaves(model.params))
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.config == TINY and isinstance(rebuilt.config, ModelConfig)
