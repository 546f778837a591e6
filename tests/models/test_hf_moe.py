"""HF interop for MoE and MLA models (Qwen3-MoE, DeepSeek-V3 / Kimi K2): the per-expert and
per-stack tensor layout, exact export round trips that transformers loads, multi-token-prediction
layers, configs HF can write but we cannot express, and expert-sharded loading.

Logits parity with transformers for these architectures runs in test_hf.py, which covers every
entry of HF_ARCHS.
"""

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from posttrain.models import HFFormatError, Transformer, from_hf, param_shapes, to_hf
from posttrain.models._hf import _SafetensorsDir
from posttrain.models._safetensors import STATS
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.testing import HF_ARCHS, hf_logits, save_tiny_hf_model

MOE_ARCHS = ("qwen3_moe", "deepseek_v3", "deepseek_v3_no_q_lora")
LENGTHS = (12, 7, 3)  # a right-padded batch


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 256, size=(len(LENGTHS), max(LENGTHS))).astype(np.int32)
    mask = (np.arange(max(LENGTHS))[None] < np.asarray(LENGTHS)[:, None]).astype(np.int32)
    return np.where(mask, tokens, 0), mask


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_dir(request, tmp_path_factory):
    return save_tiny_hf_model(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return save_tiny_hf_model("deepseek_v3", str(tmp_path_factory.mktemp("deepseek")))


def _ours(model, tokens, mask):
    fn = jax.jit(lambda m, t, s: m(t, segment_ids_BL=s))
    return np.asarray(fn(model, jnp.asarray(tokens), jnp.asarray(mask)))


def _max_diff_on_valid(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def _assert_same_params(a, b):
    flat_a = jax.tree_util.tree_leaves_with_path(a)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(flat_a, jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), jax.tree_util.keystr(path))


def _hf_load_info(path):
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return {k: v for k, v in info.items() if k != "error_msgs" and v}


def test_layers_and_experts_land_where_hf_has_them(deepseek_dir):
    """HF layer 0 is our dense stack, HF layer i > 0 is MoE layer i - 1; experts by index."""
    model = from_hf(deepseek_dir)
    p, hf = model.params, load_file(os.path.join(deepseek_dir, "model.safetensors"))
    assert p["dense_layers"]["mlp"]["gate"].shape == (1, 64, 112)
    assert p["layers"]["moe"]["experts"]["gate"].shape == (2, 8, 64, 32)
    np.testing.assert_array_equal(
        p["dense_layers"]["mlp"]["down"][0], hf["model.layers.0.mlp.down_proj.weight"].T
    )
    np.testing.assert_array_equal(
        p["layers"]["moe"]["experts"]["down"][1, 5],
        hf["model.layers.2.mlp.experts.5.down_proj.weight"].T,
    )
    np.testing.assert_array_equal(
        p["layers"]["moe"]["routing_bias"][0], hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    )
    assert np.abs(hf["model.layers.1.mlp.gate.e_score_correction_bias"]).max() > 0
    # Interleaved rope: HF's rope pairs (0, 1), (2, 3).. of the shared key become our halves.
    kv_a = hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]  # [32 + 8, 64]
    ours = np.asarray(p["layers"]["attn"]["kv_a"][0]).T
    np.testing.assert_array_equal(ours[:32], kv_a[:32])
    np.testing.assert_array_equal(ours[32:36], kv_a[32::2])
    np.testing.assert_array_equal(ours[36:], kv_a[33::2])


def test_to_hf_round_trip_is_exact(moe_dir, batch, tmp_path):
    tokens, mask = batch
    model = from_hf(moe_dir, attention="xla")
    shapes = param_shapes(model.config)  # the table fills every param, with its shape
    assert jax.tree.map(lambda x: x.shape, model.params) == jax.tree.map(lambda x: x.shape, shapes)
    to_hf(model, str(tmp_path))
    assert _hf_load_info(str(tmp_path)) == {}, "transformers reports missing/unexpected keys"
    again = from_hf(str(tmp_path), attention="xla")
    _assert_same_params(model.params, again.params)
    assert again.config == model.config.replace(name=again.config.name)
    diff = _max_diff_on_valid(
        _ours(model, tokens, mask), hf_logits(str(tmp_path), tokens, mask), mask
    )
    assert diff <= 1e-4, f"max |ours - HF(exported)| = {diff}"


def test_mla_without_experts_exports(deepseek_dir, batch, tmp_path):
    """A dense MLA model (no HF checkpoint behind it) is a deepseek_v3 with every layer dense."""
    tokens, mask = batch
    config = from_hf(deepseek_dir).config.replace(moe=None, first_k_dense=0)
    model = Transformer.init(config.replace(attention="xla"), 0)
    to_hf(model, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["first_k_dense_replace"] == 3
    assert _hf_load_info(str(tmp_path)) == {}
    diff = _max_diff_on_valid(
        _ours(model, tokens, mask), hf_logits(str(tmp_path), tokens, mask), mask
    )
    assert diff <= 1e-4


def _edit_config(path, **changes):
    config_path = os.path.join(path, "config.json")
    config = {**json.load(open(config_path)), **changes}
    with open(config_path, "w") as f:
        json.dump(config, f)


def _rms_norm(x, w, eps):
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def test_multi_token_prediction_layer_loads_as_a_drafter(deepseek_dir, tmp_path, caplog):
    """DeepSeek-V3 checkpoints append an MTP layer after the last (HF ignores it): `from_hf`
    leaves it out, `mtp_from_hf` loads it, and its logits equal a reference built from
    transformers' own decoder layer (MLA, experts) plus the MTP projections written out."""
    import torch
    import transformers

    from posttrain.models import lm_logits, mtp_from_hf

    path = str(tmp_path / "with_mtp")
    model = from_hf(deepseek_dir, attention="xla")
    to_hf(model, path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    rs = np.random.RandomState(0)
    D = model.config.embed_dim
    mtp = {  # a block like the last layer's, perturbed; the MTP projections; shared copies
        k.replace("model.layers.2.", "model.layers.3."): v + 0.05 * rs.standard_normal(v.shape)
        for k, v in tensors.items()
        if k.startswith("model.layers.2.")
    }
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{name}.weight"] = 1 + 0.1 * rs.standard_normal(D)
    mtp["model.layers.3.eh_proj.weight"] = 0.1 * rs.standard_normal((D, 2 * D))
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    mtp = {k: np.asarray(v, np.float32) for k, v in mtp.items()}
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    _edit_config(path, num_nextn_predict_layers=1)
    with caplog.at_level(logging.INFO, logger="posttrain.models._hf"):
        loaded = from_hf(path, attention="xla")
    _assert_same_params(model.params, loaded.params)
    assert f"skipped {len(mtp)} tensors of 1 multi-token-prediction layer" in caplog.text
    module = mtp_from_hf(path, attention="xla")

    tokens = np.random.RandomState(1).randint(1, 256, size=(2, 10))
    hidden = model.hidden_states(jnp.asarray(tokens))
    ours = lm_logits(
        model.params, module(model.params, tokens[:, 1:], hidden[:, :-1]), model.config
    )

    # Reference: the model's final hidden states h_i and the next tokens t_{i+1} through
    # eh_proj([enorm(embed(t)); hnorm(h)]), HF's decoder layer (HF loads the MTP layer's block
    # as a fourth layer) and shared_head.norm, then the model's lm_head.
    kwargs = dict(attn_implementation="eager", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    block = (
        transformers.AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=4, **kwargs)
        .eval()
        .model.layers[3]
    )
    eps, L = hf.config.rms_norm_eps, tokens.shape[1] - 1
    w = {k: torch.tensor(v) for k, v in mtp.items()}
    with torch.no_grad():
        t = torch.tensor(tokens)
        h = hf.model(t).last_hidden_state[:, :-1]
        e = hf.model.embed_tokens(t[:, 1:])
        x = (
            torch.cat(
                [
                    _rms_norm(e, w["model.layers.3.enorm.weight"], eps),
                    _rms_norm(h, w["model.layers.3.hnorm.weight"], eps),
                ],
                -1,
            )
            @ w["model.layers.3.eh_proj.weight"].T
        )
        positions = torch.arange(L)[None]
        causal = torch.full((L, L), float("-inf")).triu(1)[None, None]
        g = block(
            x,
            attention_mask=causal,
            position_ids=positions,
            position_embeddings=hf.model.rotary_emb(x, positions),
        )
        expected = hf.lm_head(_rms_norm(g, w["model.layers.3.shared_head.norm.weight"], eps))
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), atol=1e-4, rtol=0)

    _edit_config(path, num_nextn_predict_layers=0)  # then they are tensors nobody expects
    with pytest.raises(HFFormatError, match=r"does not use, e.g. \['model.layers.3."):
        from_hf(path)
    with pytest.raises(HFFormatError, match="no multi-token-prediction layers"):
        mtp_from_hf(path)
    with pytest.raises(HFFormatError, match="model.layers.3.enorm.weight' is missing"):
        mtp_from_hf(deepseek_dir)


def test_kimi_k2_model_type_reads_as_deepseek_v3(deepseek_dir, tmp_path):
    path = str(tmp_path / "kimi")
    to_hf(from_hf(deepseek_dir), path)
    _edit_config(path, model_type="kimi_k2")
    assert from_hf(path).config.mla is not None


@pytest.mark.parametrize(
    "arch, changes, match",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 .*not supported"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias=true .* not supported"),
        ("deepseek_v3", {"num_experts_per_tok": 9}, "top_k=9 exceeds num_experts=8"),
        (
            "deepseek_v3",
            {"quantization_config": {"quant_method": "fp8"}},
            "fp8 quantized weights are not supported; dequantize",
        ),
    ],
)
def test_inexpressible_configs_are_named(arch, changes, match, tmp_path):
    """Settings we cannot express fail on config.json alone, before any weight is read."""
    import transformers

    class_name, kwargs = HF_ARCHS[arch]
    getattr(transformers, class_name)(**kwargs).save_pretrained(str(tmp_path))
    _edit_config(str(tmp_path), **changes)
    with pytest.raises(HFFormatError, match=match):
        from_hf(str(tmp_path))


def test_export_refuses_what_hf_cannot_express(deepseek_dir, tmp_path):
    model = from_hf(deepseek_dir)
    softmax = model.config.replace(moe=dataclasses.replace(model.config.moe, score_func="softmax"))
    with pytest.raises(ValueError, match="deepseek_v3 .*softmax router scores"):
        to_hf(Transformer(model.params, softmax), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out"), "nothing is written for a refused export"
    dense_attn = model.config.replace(mla=None, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="qwen3_moe .*no qk_norm.*sigmoid router scores"):
        to_hf(Transformer(model.params, dense_attn), str(tmp_path / "out"))


def test_expert_sharded_load_matches(deepseek_dir, batch, tmp_path, devices, monkeypatch):
    """A sharded checkpoint loads onto expert x fsdp; each HF tensor is read exactly once."""
    tokens, mask = batch
    model = from_hf(deepseek_dir, attention="xla")
    path = str(tmp_path / "sharded")
    to_hf(model, path, max_shard_bytes=100_000)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    reads, read = [], _SafetensorsDir.read

    def counted_read(self, regions):
        reads.extend(region.name for region in regions)
        return read(self, regions)

    monkeypatch.setattr(_SafetensorsDir, "read", counted_read)
    STATS.reset()
    mesh = make_mesh(MeshConfig.from_dict({"expert": 4, "fsdp": 2}))
    sharded = from_hf(path, mesh=mesh, attention="xla")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert sorted(set(reads)) == sorted(index["weight_map"])
    assert STATS.tensor_bytes == index["metadata"]["total_size"]  # every byte read once
    gate = sharded.params["layers"]["moe"]["experts"]["gate"]  # [T, E, D, F]: E/4, D/2
    assert gate.sharding.shard_shape(gate.shape) == (2, 2, 32, 32)
    _assert_same_params(model.params, sharded.params)
    with jax.set_mesh(mesh):
        logits = _ours(sharded, tokens, mask)
    diff = _max_diff_on_valid(logits, hf_logits(deepseek_dir, tokens, mask), mask)
    assert diff <= 1e-4, f"max |ours(expert-sharded) - HF| = {diff}"
