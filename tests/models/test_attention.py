"""Attention implementations against the XLA reference (fused kernels only where they run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models import (
    Transformer,
    attention,
    attention_mask,
    get_preset,
    param_shapes,
    param_shardings,
)
from posttrain.parallel import MeshConfig, make_mesh, named_sharding

ON_GPU = jax.default_backend() == "gpu"


def _qkv(seed, B=2, L=256, N=8, K=2, H=64, dtype=jnp.bfloat16):
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(B, L, n, H), dtype) for n in (N, K, K))
    return q, k, v


def _packing(B=2, L=256):
    """Row 0: one document; row 1: three documents and padding."""
    segments = np.ones((B, L), np.int32)
    positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    cuts = [0, L * 2 // 5, L * 7 // 10, L * 15 // 16, L]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        segments[1, a:b] = i + 1 if b < L else 0
        positions[1, a:b] = np.arange(b - a)
    return jnp.asarray(positions), jnp.asarray(segments)


def test_reference_matches_dense_softmax():
    """The XLA path equals a naive per-head loop with an explicit mask."""
    q, k, v = _qkv(0, L=16, dtype=jnp.float32)
    positions, segments = _packing(L=16)
    mask = np.asarray(attention_mask(positions, positions, segments, segments, window=5))
    out = np.asarray(
        attention(
            q,
            k,
            v,
            q_positions_BL=positions,
            kv_positions_BS=positions,
            q_segment_ids_BL=segments,
            kv_segment_ids_BS=segments,
            window=5,
        )
    )
    qn, kn, vn = map(np.asarray, (q, k, v))
    for b in range(2):
        for n in range(8):
            s = qn[b, :, n] @ kn[b, :, n // 4].T / 8.0
            s = np.where(mask[b], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[b, :, n], p @ vn[b, :, n // 4], atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN flash attention needs a GPU")
@pytest.mark.parametrize("window", [0, 32])
def test_cudnn_matches_reference(window):
    q, k, v = _qkv(0)
    positions, segments = _packing()
    kwargs = dict(
        q_positions_BL=positions,
        kv_positions_BS=positions,
        q_segment_ids_BL=segments,
        kv_segment_ids_BS=segments,
        window=window,
    )

    def loss(q, k, v, impl):
        out = attention(q, k, v, impl=impl, **kwargs)
        valid = (segments > 0)[:, :, None, None]
        return jnp.sum(jnp.where(valid, out.astype(jnp.float32), 0.0) ** 2), out

    (_, ref), ref_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "xla")
    (_, got), got_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, "cudnn"
    )
    valid = np.asarray(segments > 0)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32))[valid].max()
    assert diff < 2e-2, f"cuDNN output differs from the reference by {diff}"
    for g, r in zip(got_grads, ref_grads, strict=True):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-2


@pytest.mark.skipif(not ON_GPU, reason="cuDNN flash attention needs a GPU")
def test_model_with_cudnn_matches_xla():
    config = get_preset(
        "tiny",
        embed_dim=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        compute_dtype="bfloat16",
        sliding_window=64,
        sliding_window_layers=(1,),
    )
    model = Transformer.init(config.replace(attention="xla"), rng=0)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 256)), jnp.int32)
    positions, segments = _packing()
    ref = model(tokens, positions, segments)
    got = Transformer(model.params, config.replace(attention="cudnn"))(tokens, positions, segments)
    valid = np.asarray(segments > 0)
    assert np.abs(np.asarray(got) - np.asarray(ref))[valid].max() < 5e-2


@pytest.fixture
def splash_on_cpu(monkeypatch):
    """Runs the splash kernel in Pallas interpret mode, so its masks, GQA grouping, scaling and
    shard_map wrapper are checked on CPU against the reference."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    from posttrain.models import _attention

    monkeypatch.setattr(
        splash, "make_splash_mha", functools.partial(splash.make_splash_mha, interpret=True)
    )
    monkeypatch.setattr(_attention, "_target_platform", lambda: "tpu")


def test_splash_kernel_matches_reference_sharded(splash_on_cpu, devices):
    config = get_preset(
        "tiny",
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=40,
        sliding_window_layers=(1,),
    )
    model = Transformer.init(config.replace(attention="xla"), rng=0)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 512, (2, 128)), jnp.int32)
    positions, segments = _packing(L=128)
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 2, "data": 2}))

    def loss(params, impl):
        logits = Transformer(params, config.replace(attention=impl))(tokens, positions, segments)
        return jnp.sum(jnp.where((segments > 0)[..., None], logits, 0.0) ** 2) / 1e3, logits

    grad = jax.value_and_grad(loss, has_aux=True)
    (_, ref), ref_grads = grad(model.params, "xla")
    with jax.set_mesh(mesh):
        (_, got), got_grads = jax.jit(grad, static_argnums=1)(model.params, "splash")
    valid = np.asarray(segments > 0)
    assert np.abs(np.asarray(got) - np.asarray(ref))[valid].max() < 1e-4
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True):
        assert np.linalg.norm(np.asarray(g) - r) <= 1e-4 * np.linalg.norm(r)


def test_soft_capped_scores_match_in_flash_and_splash(splash_on_cpu):
    """Gemma 2's `cap * tanh(scores / cap)` on a packed batch with a sliding window: flash and
    splash (interpreted) give the XLA reference's values and gradients; the cap moves the
    output by ~10."""
    window = 40
    from posttrain.models._flash import flash_attention

    q, k, v = (x * 3 for x in _qkv(0, L=128, N=4, dtype=jnp.float32))
    positions, segments = _packing(L=128)
    ids = dict(q_positions_BL=positions, kv_positions_BS=positions)
    ids |= dict(q_segment_ids_BL=segments, kv_segment_ids_BS=segments)
    valid = np.asarray(segments > 0)[..., None, None]

    def run(impl, softcap=5.0):
        def f(q, k, v):
            if impl == "flash":  # with blocks smaller than the rows
                args = (positions, positions, segments, segments, window)
                out = flash_attention(q, k, v, *args, scale=0.2, softcap=softcap, block_q=32,
                                      block_k=48)  # fmt: skip
            else:
                out = attention(q, k, v, window=window, impl=impl, scale=0.2, softcap=softcap,
                                self_attention=True, **ids)  # fmt: skip
            return jnp.where(valid, out, 0.0)

        out, vjp = jax.vjp(jax.jit(f), q, k, v)
        return out, vjp(jnp.ones_like(out))

    ref, ref_grads = run("xla")
    assert np.abs(np.asarray(run("xla", softcap=0.0)[0] - ref)).max() > 5
    for impl in ("flash", "splash"):
        out, grads = run(impl)
        assert np.abs(np.asarray(out - ref)).max() < 1e-4, impl
        for g, r in zip(grads, ref_grads, strict=True):
            assert np.linalg.norm(np.asarray(g - r)) <= 1e-4 * np.linalg.norm(r), impl


def test_splash_compiles_for_tpu_ahead_of_time():
    """With libtpu (the `tpu` extra) the fused kernel is what XLA compiles for a TPU slice."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 2}), devices=topology.devices)
    config = get_preset("tiny", compute_dtype="bfloat16", num_heads=4, num_kv_heads=2, head_dim=128)
    params = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        param_shapes(config),
        param_shardings(config, mesh),
    )
    tokens = jax.ShapeDtypeStruct(
        (8, 256), jnp.int32, sharding=named_sharding(("act_batch",), (8, 256), mesh)
    )
    kernels = {}
    for impl in ("auto", "xla"):

        def loss(params, tokens, impl=impl):
            return Transformer(params, config.replace(attention=impl))(tokens).mean()

        with jax.set_mesh(mesh):
            hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
        kernels[impl] = hlo.count('custom_call_target="tpu_custom_call"')
    assert kernels["auto"] >= 2 and kernels["xla"] == 0, kernels  # forward and backward kernels
