"""Context parallelism on 8 fake CPU devices: rows sharded over `sequence` (alone and with
fsdp, tensor and data) give one device's attention, losses and gradients, by ring and by
all-gather."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import attention, get_preset
from posttrain.parallel import MeshConfig, make_mesh
from tests.losses.test_chunked import close_trees, loss_and_grads
from tests.models.test_attention import _packing, _qkv
from tests.tolerance import assert_close

ROWS, LENGTH = 4, 64


def _mesh(devices, **axes):
    return make_mesh(MeshConfig.from_dict(axes), devices[: int(np.prod(list(axes.values())))])


@pytest.mark.parametrize(
    "axes, mode, Hv",
    [({"sequence": 8}, "ring", 32), ({"sequence": 4, "tensor": 2}, "all_gather", 64)],
    ids=["ring8_mla_values", "all_gather4_tensor2"],
)
def test_sharded_attention_equals_one_device(devices, axes, mode, Hv):
    """Packed rows (three documents and padding in row 1), GQA, a 40-token window, values with
    a smaller head dim than the keys (MLA's): outputs and gradients of q, k and v; the compiled
    program passes keys around (collective-permute) or gathers them."""
    q, k, v = _qkv(0, L=LENGTH * 4, dtype=jnp.float32)
    v = v[..., :Hv]
    positions, segments = _packing(L=LENGTH * 4)
    ids = dict(q_positions_BL=positions, kv_positions_BS=positions)
    ids |= dict(q_segment_ids_BL=segments, kv_segment_ids_BS=segments)
    cotangent = jnp.asarray(np.random.RandomState(1).randn(*q.shape[:3], Hv), jnp.float32)

    def fn(q, k, v):
        out = attention(q, k, v, window=40, self_attention=True, context_parallel=mode, **ids)
        return out, jnp.sum(out * cotangent)

    run = jax.jit(jax.value_and_grad(lambda *x: fn(*x)[1], argnums=(0, 1, 2)))
    expected = run(q, k, v)
    with jax.set_mesh(_mesh(devices, **axes)):
        hlo = run.lower(q, k, v).compile().as_text()
        got = jax.device_get(run(q, k, v))
    assert ("collective-permute" if mode == "ring" else "all-gather") in hlo
    assert_close(got[0], expected[0], rtol=1e-5)
    for name, a, b in zip("qkv", got[1], expected[1], strict=True):
        assert_close(a, b, rtol=1e-5, scale=np.abs(b).max(), err_msg=f"d{name}")


# A sliding window on the first layer; every mesh shards the length.
WINDOWED = get_preset("tiny", attention="xla", sliding_window=24, sliding_window_layers=(0,))
MESHES = {
    "seq8": {"sequence": 8},
    "seq4_fsdp2": {"sequence": 4, "fsdp": 2},
    "seq2_fsdp2_tensor2": {"sequence": 2, "fsdp": 2, "tensor": 2},
    "seq2_data2_tensor2": {"data": 2, "sequence": 2, "tensor": 2},
}


@functools.cache
def _one_device(method: str):
    return loss_and_grads(method, WINDOWED, rows=ROWS, length=LENGTH)


@pytest.mark.parametrize(
    "method, mesh, mode",
    [  # ~20 s each; sequence 8 and all-gather on the model in `make test-slow`
        pytest.param("sft", "seq8", "ring", marks=pytest.mark.slow),
        pytest.param("sft", "seq4_fsdp2", "all_gather", marks=pytest.mark.slow),
        ("sft", "seq2_fsdp2_tensor2", "ring"),
        ("dpo", "seq4_fsdp2", "ring"),
        ("grpo", "seq2_data2_tensor2", "ring"),
    ],
)
def test_sequence_sharded_losses_equal_one_device(devices, method, mesh, mode):
    """The loss sums (every metric's numerator) and the parameter gradients of SFT on packed
    rows, DPO and the GRPO loss with 8-position logits chunks, on the windowed tiny model."""
    config = WINDOWED.replace(context_parallel=mode, logits_chunk=8)
    collective = {"ring": "collective_permute", "all_gather": "all_gather"}[mode]
    mesh = _mesh(devices, **MESHES[mesh])
    (_, sums), grads = loss_and_grads(
        method, config, rows=ROWS, length=LENGTH, mesh=mesh, collective=collective
    )

    ((_, sums0), grads0) = _one_device(method)
    for name, value in sums0.items():
        assert_close(sums[name], value, rtol=1e-5, err_msg=name)
    # (The ring reorders each row's tokens (`zigzag_rows`): weight gradients sum them in
    # another order, a few more ulps of the largest entry than a plain sharding.)
    close_trees(grads, grads0, rtol=1e-5, ulps=64)


def _attention_training_flops(fn, q, k, v, mesh=None) -> float:
    from posttrain._flops import matmul_flops

    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
    if mesh is None:
        return matmul_flops(jax.make_jaxpr(grad)(q, k, v).jaxpr)
    with jax.set_mesh(mesh):
        return matmul_flops(jax.make_jaxpr(grad)(q, k, v).jaxpr)


@pytest.mark.parametrize("sequence", [1, 8])
def test_causal_attention_computes_each_visible_tile_once(devices, sequence):
    """Program FLOPs (every matmul of the training step's jaxpr, as `posttrain compile` counts
    them) of causal attention over 32k tokens: within 1.25x of the model's count (half the
    [L, L] scores, 3 passes: forward and backward), on one device (`flash`, tiles above the
    diagonal left out) and over 8 (the zigzag ring: two half tiles a hop). The floor is 7/6:
    the backward pass recomputes the scores (FlashAttention-2). Before: 2.9x at 128k."""
    L, N, K, H = 32_768, 4, 2, 16
    q, k, v = (jax.ShapeDtypeStruct((1, L, n, H), jnp.float32) for n in (N, K, K))
    positions = jnp.arange(L, dtype=jnp.int32)[None]
    segments = jnp.ones((1, L), jnp.int32)
    ids = dict(q_positions_BL=positions, kv_positions_BS=positions)
    ids |= dict(q_segment_ids_BL=segments, kv_segment_ids_BS=segments)

    def causal(q, k, v):
        return attention(q, k, v, impl="flash", self_attention=True, **ids)

    mesh = _mesh(devices, sequence=sequence) if sequence > 1 else None
    model = 3 * N * (H + H) * L * L  # get_preset(...).flops_per_token's attention term x L
    ratio = _attention_training_flops(causal, q, k, v, mesh) / model
    print(f"program / model attention FLOPs on {sequence} device(s): {ratio:.3f}")
    assert 7 / 6 <= ratio <= 1.25, ratio
    if sequence == 1:  # every tile, as before: twice the causal ones

        def every(q, k, v):
            return attention(q, k, v, impl="flash", self_attention=False, **ids)

        assert _attention_training_flops(every, q, k, v) / model == pytest.approx(2 * 7 / 6)


def test_zigzag_rows_balance_causal_work_across_the_sequence_axis(devices):
    """Each device's causal attention work (the visible (query, key) pairs of its queries:
    position + 1 each) over 8 devices: within 10% of the others' in zigzag order (15x apart
    in the rows' own order), and the inverse restores the rows."""
    from posttrain.models._context import zigzag_rows

    L, n = 1024, 8
    positions = jnp.tile(jnp.arange(L, dtype=jnp.int32), (2, 1))
    with jax.set_mesh(_mesh(devices, sequence=n)):
        zigzag = jax.jit(lambda x: zigzag_rows(x, ("act_batch", "act_length")))(positions)
        back = jax.jit(lambda x: zigzag_rows(x, ("act_batch", "act_length"), inverse=True))(zigzag)
    np.testing.assert_array_equal(back, positions)
    assert sorted(np.asarray(zigzag[0]).tolist()) == list(range(L))

    def work(order):
        return np.asarray(order[0] + 1).reshape(n, L // n).sum(axis=1)

    balanced, contiguous = work(zigzag), work(positions)
    assert balanced.max() / balanced.min() <= 1.10, balanced
    assert contiguous.max() / contiguous.min() > 10, contiguous


def test_no_tile_of_the_ring_is_kept_across_layers(devices):
    """The largest array of the tiny model's training step over 16k tokens on 8 devices (ring
    attention, full remat) is an activation, not a stack of per-tile masks or scores: the layer
    scan's partial evaluation once hoisted every tile's mask out of the loop (one per hop and
    tile: 7 x 4 x [4, 2, 512, 512] here, 356 GiB per chip in the 128k plan)."""
    from jax.extend.core import jaxprs_in_params

    from posttrain.models import Transformer

    L = 16_384
    config = get_preset("tiny", attention="flash", remat="full", max_seq_len=L)
    params = jax.eval_shape(lambda: Transformer.init(config, rng=0).params)

    def loss(params):
        return jnp.sum(Transformer(params, config).hidden_states(jnp.zeros((1, L), jnp.int32)))

    with jax.set_mesh(_mesh(devices, sequence=8)):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr

    def largest(jaxpr) -> int:
        sizes = [v.aval.size * v.aval.dtype.itemsize for e in jaxpr.eqns for v in e.outvars
                 if hasattr(v.aval, "size")]  # fmt: skip
        subs = [largest(getattr(j, "jaxpr", j)) for e in jaxpr.eqns
                for j in jaxprs_in_params(e.params)]  # fmt: skip
        return max(sizes + subs + [0])

    activation = L * config.num_heads * config.head_dim * 4 * config.num_layers
    assert largest(jaxpr) <= 2 * activation, largest(jaxpr)


def test_rows_that_do_not_split_into_two_chunks_a_device_gather_keys_instead(devices, caplog):
    """200 tokens over 8 devices: 25 each, not two equal chunks a device. The ring cannot
    balance them; the keys are gathered instead (warned once), same attention as one device."""
    L = 200
    q, k, v = _qkv(0, L=L, dtype=jnp.float32)
    positions, segments = _packing(L=L)
    ids = dict(q_positions_BL=positions, kv_positions_BS=positions)
    ids |= dict(q_segment_ids_BL=segments, kv_segment_ids_BS=segments)
    run = jax.jit(lambda q, k, v: attention(q, k, v, self_attention=True, **ids))
    expected = run(q, k, v)
    with jax.set_mesh(_mesh(devices, sequence=8)), caplog.at_level("WARNING", "posttrain"):
        hlo = run.lower(q, k, v).compile().as_text()
        got = run(q, k, v)
    assert "all-gather" in hlo and "do not split into 2 x 8 chunks" in caplog.text
    assert_close(got, expected, rtol=1e-5)


def test_full_remat_recomputes_the_layers_matmuls_but_not_the_ring(devices):
    """Program FLOPs of the tiny model's step over 16k tokens on 8 devices: full remat adds
    exactly one more forward of the layers' weight matmuls (2 x their parameters a token) to
    remat `none`; the ring's forward hops, kept by name (`context_attention`), are not
    recomputed (they would add several times as much at this length)."""
    from posttrain._flops import matmul_flops
    from posttrain.models import Transformer

    L = 16_384
    counts = {}
    for remat in ("none", "full"):
        config = get_preset("tiny", attention="flash", remat=remat, max_seq_len=L)
        params = jax.eval_shape(lambda config=config: Transformer.init(config, rng=0).params)

        def loss(params, config=config):
            tokens = jnp.zeros((1, L), jnp.int32)
            return jnp.sum(Transformer(params, config).hidden_states(tokens))

        with jax.set_mesh(_mesh(devices, sequence=8)):
            counts[remat] = matmul_flops(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    layer_matmuls = config.flops_per_token(0, lm_head=False) / 6  # weight params a token
    # (The output projection is not recomputed either: its input is the kept attention output
    # and its own output is not needed by the backward pass.)
    out_projection = config.num_layers * config.num_heads * config.head_dim * config.embed_dim
    recomputed = 2 * (layer_matmuls - out_projection) * L
    assert counts["full"] - counts["none"] == pytest.approx(recomputed, rel=1e-6)
