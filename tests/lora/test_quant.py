"""QLoRA's quantised base: codes against brute-force references, scan slices, the model's
logits, byte counts and shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from posttrain.lora import LoRAConfig, adapter_specs, target_paths
from posttrain.lora._quant import (
    NF4_CODEBOOK,
    QUANT_FORMATS,
    QuantizedWeight,
    dequantize,
    dequantize_tree,
    param_bytes,
    quant_paths,
    quantize_params,
    quantize_weight,
    quantized_shapes,
    quantized_shardings,
)
from posttrain.models import ParamSpec, forward, get_preset, param_shardings, param_specs
from posttrain.parallel import MeshConfig, make_mesh

TOKENS = np.random.RandomState(0).randint(0, 512, (4, 32)).astype(np.int32)
# Jitted: one compile per call instead of one per primitive.
quantize = jax.jit(quantize_weight, static_argnums=(1, 2, 3))
unquantize = jax.jit(dequantize)


def _random_params(config, seed=0):
    """`init_params`' distribution (normal std 0.02, norms 1, biases 0) drawn in numpy: no
    compile."""
    rng = np.random.RandomState(seed)

    def draw(spec):
        if spec.init == "ones":
            return jnp.ones(spec.shape, jnp.float32)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, jnp.float32)
        return jnp.asarray(0.02 * rng.standard_normal(spec.shape), jnp.float32)

    return jax.tree.map(draw, param_specs(config), is_leaf=lambda x: isinstance(x, ParamSpec))


def _blocks_np(w, axis, block):
    """`[..., n, ...]` -> `[..., n // block, block, ...]` at the negative `axis`, in numpy."""
    ax = w.ndim + axis
    return w.reshape(*w.shape[:ax], w.shape[ax] // block, block, *w.shape[ax + 1 :])


def _nearest(x, levels):
    """Brute force: the index of the nearest level of every x, and its margin over the next."""
    dist = np.abs(x[..., None] - levels)
    order = np.sort(dist, axis=-1)
    return np.argmin(dist, axis=-1), order[..., 1] - order[..., 0]


def test_nf4_codebook_is_the_papers_normal_quantiles():
    # QLoRA appendix E / bitsandbytes `create_normal_map(offset=0.9677083)`: 8 positive and 7
    # negative quantiles of N(0, 1), a zero, rescaled to [-1, 1].
    from scipy.stats import norm

    offset = 0.9677083
    pos = norm.ppf(np.linspace(offset, 0.5, 9)[:-1])
    neg = -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])
    levels = np.sort(np.concatenate([pos, [0.0], neg]))
    np.testing.assert_allclose(NF4_CODEBOOK, levels / levels.max(), atol=1e-6)
    assert NF4_CODEBOOK[7] == 0.0 and NF4_CODEBOOK[0] == -1.0 and NF4_CODEBOOK[15] == 1.0


def test_int8_round_trip_is_within_half_a_step():
    w = np.random.RandomState(0).standard_normal((3, 64, 5, 4)).astype(np.float32)
    q = quantize(jnp.asarray(w), "int8", -3, 16)
    assert q.codes.dtype == jnp.int8 and q.codes.shape == w.shape
    assert q.scale.dtype == jnp.float32 and q.scale.shape == (3, 4, 5, 4)
    absmax = np.abs(_blocks_np(w, -3, 16)).max(axis=-3)  # [3, 4, 5, 4]
    np.testing.assert_array_equal(np.asarray(q.scale), absmax)
    out = np.asarray(unquantize(q))
    assert out.dtype == np.float32 and out.shape == w.shape
    # Each value is the nearest of the block's 255 levels, within half a step absmax / 254.
    a = np.expand_dims(absmax, -3)
    grid = np.arange(-127, 128, dtype=np.float32) / 127
    idx, margin = _nearest(_blocks_np(w, -3, 16) / a, grid)
    ref = (grid[idx] * a).reshape(w.shape)
    clear = margin > 1e-5
    np.testing.assert_allclose(out[clear.reshape(w.shape)], ref[clear.reshape(w.shape)], 1e-6)
    err = _blocks_np(np.abs(out - w), -3, 16)
    assert (err <= a / 254 * (1 + 1e-5)).all()
    # Default block: one absmax per output channel.
    assert quantize_weight(jnp.asarray(w), "int8", -3, 0).scale.shape == (3, 1, 5, 4)


def test_nf4_codes_are_the_nearest_level_and_pack_two_per_byte():
    w = np.random.RandomState(1).standard_normal((2, 128, 6)).astype(np.float32)
    q = quantize(jnp.asarray(w), "nf4", -2, 64)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == (2, 64, 6)
    assert q.scale.shape == (2, 2, 6) and q.block == 64 and q.shape == w.shape
    absmax = np.abs(_blocks_np(w, -2, 64)).max(axis=-2, keepdims=True)
    idx, margin = _nearest(_blocks_np(w, -2, 64) / absmax, NF4_CODEBOOK)
    idx, margin = idx.reshape(w.shape), margin.reshape(w.shape)
    ref = (NF4_CODEBOOK[_blocks_np(idx, -2, 64)] * absmax).reshape(w.shape)
    clear = margin > 1e-5  # away from a midpoint, where float rounding may pick either level
    assert clear.mean() > 0.99
    # Packing, unpacked by hand: element 2i in the high nibble, 2i + 1 in the low one.
    codes = np.asarray(q.codes)
    unpacked = np.stack([codes >> 4, codes & 0xF], axis=-2).reshape(w.shape)
    np.testing.assert_array_equal(unpacked[clear], idx[clear])
    out = np.asarray(unquantize(q))
    np.testing.assert_array_equal(out[clear], ref[clear])
    # Near a midpoint either neighbour is (to 1e-5) as near.
    a = np.repeat(absmax, 64, axis=-2).reshape(w.shape)
    best = np.abs(w / a - NF4_CODEBOOK[idx])
    assert (np.abs(w / a - out / a) <= best + 1e-5).all()
    # The block's absmax is exact (level +-1).
    assert np.abs(out - w)[np.abs(w) == a].max() == 0


def test_bfloat16_weights_and_zero_blocks():
    w = jnp.zeros((4, 64, 8), jnp.bfloat16).at[:, :32].set(1.5)
    for fmt in QUANT_FORMATS:
        q = quantize(w, fmt, -2, 32)
        assert q.dtype == "bfloat16"
        out = unquantize(q)
        assert out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(w, np.float32))


def test_bad_blocks_and_formats_are_clear():
    w = jnp.ones((2, 64, 6))
    with pytest.raises(ValueError, match="does not divide .* e.g. 32"):
        quantize_weight(w, "nf4", -2, 48)
    with pytest.raises(ValueError, match="odd"):
        quantize_weight(jnp.ones((2, 5, 6)), "nf4", -2, 0)
    with pytest.raises(ValueError, match="choose one of"):
        quantize_weight(w, "int4", -2, 0)
    with pytest.raises(ValueError, match="negative"):
        quantize_weight(w, "int8", 1, 0)
    # Blocks larger than the dim are capped at it.
    assert quantize_weight(w, "nf4", -2, 1024).block == 64
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
        param_specs(get_preset("tiny")),
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )
    with pytest.raises(
        ValueError, match=r"layers/attn/k: block 48 does not divide dim -3 \(size 64\)"
    ):
        jax.eval_shape(lambda p: quantize_params(p, get_preset("tiny"), "int8", 48), shapes)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_one_scan_slice_dequantizes_like_the_stacked_weight(fmt):
    w = jnp.asarray(np.random.RandomState(2).standard_normal((3, 64, 4, 8)), jnp.float32)
    q = quantize(w, fmt, -3, 16)
    stacked = np.asarray(unquantize(q))
    one = jax.tree.map(lambda x: x[1], q)
    assert isinstance(one, QuantizedWeight) and one.codes.ndim == 3
    np.testing.assert_array_equal(np.asarray(unquantize(one)), stacked[1])
    _, scanned = jax.jit(lambda q: jax.lax.scan(lambda c, layer: (c, dequantize(layer)), 0, q))(q)
    np.testing.assert_array_equal(np.asarray(scanned), stacked)


def test_quant_paths_are_the_layer_matrices_blocked_on_their_last_input_dim():
    config = get_preset("tiny_mla_moe")
    paths = quant_paths(config)
    assert paths == target_paths(config, LoRAConfig(targets=(".",)))
    assert ("layers", "moe", "router") not in paths
    assert ("dense_layers", "attn", "kv_b") in paths and ("layers", "moe", "shared", "up") in paths
    shapes = quantized_shapes(config, "nf4")
    assert not isinstance(shapes["embed"], QuantizedWeight)
    assert not isinstance(shapes["layers"]["attn"]["kv_norm"], QuantizedWeight)
    # The blocked dim is the weight's last input dim (the adapter `a [*lead, r, *in]`'s last).
    a_specs = adapter_specs(config, LoRAConfig(targets=(".",)))
    specs = param_specs(config)
    for path in paths:
        a, spec, q = a_specs, specs, shapes
        for key in path:
            a, spec, q = a[key], spec[key], q[key]
        assert len(spec.shape) + q.axis == len(a["a"].shape) - 2, path
    attn = shapes["layers"]["attn"]
    assert attn["kv_b"].axis == -3 and attn["o"].axis == -2 and attn["q_b"].axis == -3
    assert shapes["layers"]["moe"]["experts"]["up"].axis == -2
    assert attn["o"].block == 16  # v_head_dim 16 < 64: the block is capped at the dim
    assert quantized_shapes(get_preset("tiny"), "int8")["layers"]["attn"]["q"].axis == -3


# Measured on these random-init models (`_random_params` seeds 0-7, the 4 x 32 TOKENS; normal
# std 0.02 weights give logits at most ~0.75 in size, near-uniform, so argmax agreement is a
# weak signal here and the KL a better one), range over the seeds:
#
#   format  preset        |max logit err| / max|logit|   argmax agrees   mean KL(full || quant)
#   int8    tiny          0.007 - 0.011                  0.97 - 1.00     0.6e-6 - 0.8e-6
#           tiny_moe      0.010 - 0.040                  0.96 - 1.00     0.9e-6 - 1.8e-6
#           tiny_mla_moe  0.007 - 0.098                  0.98 - 1.00     0.5e-6 - 4.3e-6
#   nf4     tiny          0.11 - 0.17                    0.71 - 0.86     1.5e-4 - 2.0e-4
#           tiny_moe      0.14 - 0.20                    0.70 - 0.84     2.3e-4 - 2.8e-4
#           tiny_mla_moe  0.16 - 0.28                    0.75 - 0.83     1.5e-4 - 2.2e-4
#
# The largest per-position KL: int8 1.9e-4, nf4 1.1e-3. An MoE token whose top-k experts flip
# sets the max logit error (int8 tiny_mla_moe: 0.098 from one token), hence a looser MoE bound.
# Tolerances: about 2x the worst seed.
TOLERANCES = {  # format: (rel. max-abs logit error dense, MoE; argmax agreement; mean KL)
    "int8": (0.03, 0.2, 0.9, 1e-5),
    "nf4": (0.35, 0.5, 0.6, 6e-4),
}


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe", "tiny_mla_moe"])
def test_quantized_model_matches_its_dequantized_params_and_the_full_model(preset):
    config = get_preset(preset)
    params = _random_params(config)
    tokens = jnp.asarray(TOKENS % config.vocab_size)
    run = jax.jit(lambda p: forward(p, tokens, config))
    full = np.asarray(run(params))
    for fmt in QUANT_FORMATS:
        qparams, dequantized = jax.jit(
            lambda p, fmt=fmt: (q := quantize_params(p, config, fmt), dequantize_tree(q))
        )(params)
        wrapped = jax.jit(
            lambda p: forward(p, tokens, config, layer_transform=lambda lp, _: dequantize_tree(lp))
        )(qparams)
        plain = run(dequantized)  # the same shapes as `params`: no recompile
        np.testing.assert_allclose(np.asarray(wrapped), np.asarray(plain), atol=1e-5)

        rel_dense, rel_moe, agree, kl = TOLERANCES[fmt]
        out = np.asarray(wrapped)
        rel_err = rel_dense if config.moe is None else rel_moe
        assert np.abs(out - full).max() / np.abs(full).max() <= rel_err, fmt
        assert (out.argmax(-1) == full.argmax(-1)).mean() >= agree, fmt
        logp, logq = jax.nn.log_softmax(full), jax.nn.log_softmax(out)
        assert float((jnp.exp(logp) * (logp - logq)).sum(-1).mean()) <= kl, fmt


def test_param_bytes_of_the_tiny_model():
    config = get_preset("tiny")  # T 2, D 64, N 8, K 4, H 16, F 128, V 512, untied
    # Layer matrices per layer: q, o 64*8*16; k, v 64*4*16; gate, up, down 64*128.
    matrices = 2 * (2 * 8192 + 2 * 4096 + 3 * 8192)  # 98304
    rest = 2 * 512 * 64 + 64 + 2 * 2 * 64  # embed, lm_head, final/attn/mlp norms: 65856
    full = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
        param_specs(config),
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )
    assert param_bytes(full) == 4 * (matrices + rest) == 656_640
    # int8: a byte per weight; a float32 absmax per output channel (o: per head and output).
    #   q [2,1,8,16] 256, k, v [2,1,4,16] 128, o [2,8,1,64] 1024, gate, up [2,1,128] 256,
    #   down [2,1,64] 128.
    int8_scales = 256 + 2 * 128 + 1024 + 2 * 256 + 128
    assert param_bytes(quantized_shapes(config, "int8")) == 4 * rest + matrices + 4 * int8_scales
    assert param_bytes(quantized_shapes(config, "int8")) == 370_432
    # nf4: half a byte per weight; an absmax per 64 (o's head_dim 16: per 16).
    #   q 256, k, v 128, o [2,8,1,64] 1024, gate, up [2,1,128] 256, down [2,2,64] 256.
    nf4_scales = 256 + 2 * 128 + 1024 + 3 * 256
    assert param_bytes(quantized_shapes(config, "nf4")) == 4 * rest + matrices // 2 + 4 * nf4_scales
    assert param_bytes(quantized_shapes(config, "nf4")) == 321_792
    # Arrays count as their shapes do.
    assert param_bytes(_random_params(config)) == param_bytes(full)


def test_param_bytes_of_llama3_8b_from_shapes():
    config = get_preset("llama3_8b")  # float32 params; embed and lm_head stay float32
    matrices = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14_336)  # 6.98e9
    rest = 2 * 128_256 * 4096 + 4096 + 2 * 32 * 4096
    # int8 scales per output channel: q 4096, k, v 1024, o 32*4096, gate, up 14336, down 4096.
    int8_scales = 32 * (4096 + 2 * 1024 + 32 * 4096 + 2 * 14_336 + 4096)
    assert param_bytes(quantized_shapes(config, "int8")) == 4 * (rest + int8_scales) + matrices
    # nf4: one float32 absmax per 64 weights (every blocked dim is a multiple of 64).
    assert param_bytes(quantized_shapes(config, "nf4")) == 4 * rest + matrices // 2 + matrices // 16


def test_quantized_shardings_shard_codes_like_their_weight(devices):
    config = get_preset("tiny")
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 4, "tensor": 2}))
    params = _random_params(config)
    sharded_params = jax.device_put(params, param_shardings(config, mesh))
    weights = param_shardings(config, mesh)
    for fmt in QUANT_FORMATS:
        shardings = quantized_shardings(config, fmt, 0, mesh)
        quantize = jax.jit(quantize_params, static_argnums=(1, 2), out_shardings=shardings)
        qparams = quantize(sharded_params, config, fmt)
        for path in quant_paths(config):
            q, w, s = qparams, weights, shardings
            for key in path:
                q, w, s = q[key], w[key], s[key]
            assert q.codes.sharding == s.codes and q.scale.sharding == s.scale
            assert q.codes.sharding.spec == w.spec, (fmt, path)  # every codes dim divides here
        q = qparams["layers"]["attn"]["q"]  # [T, D, N, H]: D on fsdp, N on tensor
        assert q.codes.sharding.spec == P(None, "fsdp", "tensor")
        assert q.scale.sharding.spec == P(None, None, "tensor")  # one block of D: replicated
        assert qparams["embed"].sharding == weights["embed"]
        expected = jax.jit(quantize_params, static_argnums=(1, 2))(params, config, fmt)
        for got, want in zip(jax.tree.leaves(qparams), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
