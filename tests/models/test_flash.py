"""`attention="flash"` (query and key blocks, online softmax, rematerialised) against the XLA
reference: values and gradients, with packing, padding, GQA, windows and MLA's value heads."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import Transformer, attention, get_preset
from posttrain.models._flash import flash_attention
from tests.tolerance import assert_close

from .test_attention import _packing, _qkv


@pytest.mark.parametrize(
    "window, Hv, blocks",
    [(0, 64, (32, 48)), (40, 64, (64, 16)), (0, 32, (128, 72))],
    ids=["causal", "window", "mla_values"],
)
def test_flash_matches_the_reference(window, Hv, blocks):
    """L = 200: no block size divides it (padded queries and keys); row 1 packs three documents
    and padding, so whole key blocks are skipped for some query blocks."""
    L = 200
    q, k, v = _qkv(0, L=L, dtype=jnp.float32)
    v = v[..., :Hv]
    positions, segments = _packing(L=L)
    ids = dict(q_positions_BL=positions, kv_positions_BS=positions)
    ids |= dict(q_segment_ids_BL=segments, kv_segment_ids_BS=segments)
    cotangent = jnp.asarray(np.random.RandomState(1).randn(2, L, 8, Hv), jnp.float32)

    def reference(q, k, v):
        return attention(q, k, v, window=window, impl="xla", **ids)

    def flash(q, k, v):
        args = (positions, positions, segments, segments, window)
        return flash_attention(q, k, v, *args, scale=64**-0.5, block_q=blocks[0], block_k=blocks[1])

    results = []
    for fn in (reference, flash):
        out, vjp = jax.vjp(jax.jit(fn), q, k, v)
        results.append((out, vjp(cotangent)))
    (out0, grads0), (out1, grads1) = results
    assert_close(out1, out0, rtol=1e-5, err_msg="out")
    for name, a, b in zip("qkv", grads1, grads0, strict=True):
        assert_close(a, b, rtol=1e-5, scale=np.abs(b).max(), err_msg=f"d{name}")


def test_model_with_flash_matches_xla():
    """A packed batch through the tiny model (sliding windows on some layers): logits and
    parameter gradients of flash equal XLA's."""
    config = get_preset("tiny", sliding_window=24, sliding_window_layers=(0,), max_seq_len=128)
    model = Transformer.init(config.replace(attention="xla"), rng=0)
    positions, segments = _packing(L=96)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 96)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=1)
    def loss_and_grads(params, impl):
        def loss(params):
            logits = Transformer(params, config.replace(attention=impl))(
                tokens, positions, segments
            )
            return jnp.sum(jax.nn.log_softmax(logits)[..., 7]), logits

        return jax.value_and_grad(loss, has_aux=True)(params)

    (_, logits0), grads0 = loss_and_grads(model.params, "xla")
    (_, logits1), grads1 = loss_and_grads(model.params, "flash")
    assert_close(logits1, logits0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0), strict=True):
        assert_close(a, b, rtol=1e-4, scale=np.abs(b).max())
