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
