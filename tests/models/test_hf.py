"""HF interop: logits parity with transformers, export round trip, sharded loading, bad input."""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from posttrain.models import PRESETS, HFFormatError, from_hf, param_shapes, to_hf
from posttrain.models._hf_config import config_from_hf, config_to_hf
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.testing import HF_ARCHS, hf_logits, save_tiny_hf_model

LENGTHS = (12, 7, 3)  # a right-padded batch: rows of different lengths


@pytest.fixture(scope="module")
def batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 256, size=(len(LENGTHS), max(LENGTHS))).astype(np.int32)
    mask = (np.arange(max(LENGTHS))[None] < np.asarray(LENGTHS)[:, None]).astype(np.int32)
    return np.where(mask, tokens, 0), mask


@pytest.fixture(scope="module", params=sorted(HF_ARCHS))
def hf_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return save_tiny_hf_model(request.param, path)


def _ours(model, tokens, mask):
    return np.asarray(
        jax.jit(lambda m, t, s: m(t, segment_ids_BL=s))(
            model, jnp.asarray(tokens), jnp.asarray(mask)
        )
    )


def _max_diff_on_valid(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def test_logits_match_transformers(hf_dir, batch):
    tokens, mask = batch
    model = from_hf(hf_dir, attention="xla")
    assert model.params["embed"].dtype == jnp.float32
    diff = _max_diff_on_valid(_ours(model, tokens, mask), hf_logits(hf_dir, tokens, mask), mask)
    assert diff <= 1e-4, f"max |logits - HF| = {diff}"


def test_to_hf_round_trip(hf_dir, batch, tmp_path):
    tokens, mask = batch
    model = from_hf(hf_dir, attention="xla")
    to_hf(model, str(tmp_path))
    exported = json.load(open(tmp_path / "config.json"))
    original = json.load(open(os.path.join(hf_dir, "config.json")))
    assert exported["model_type"] == original["model_type"]
    diff = _max_diff_on_valid(
        hf_logits(str(tmp_path), tokens, mask), hf_logits(hf_dir, tokens, mask), mask
    )
    assert diff <= 1e-5, f"exported model's logits differ from the original by {diff}"


def test_sharded_checkpoint_loads_onto_mesh(batch, tmp_path, devices):
    """Export into many shards with an index, reload onto an fsdp x tensor mesh."""
    tokens, mask = batch
    src = save_tiny_hf_model("qwen3", str(tmp_path / "src"))
    model = from_hf(src, attention="xla")
    to_hf(model, str(tmp_path / "sharded"), max_shard_bytes=40_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 3
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 2, "tensor": 4}))
    sharded = from_hf(str(tmp_path / "sharded"), mesh=mesh, attention="xla")
    q = sharded.params["layers"]["attn"]["q"]  # [T, D, N, H] -> D over fsdp, N over tensor
    assert q.sharding.shard_shape(q.shape) == (2, 32, 2, 16)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(sharded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with jax.set_mesh(mesh):
        diff = _max_diff_on_valid(_ours(sharded, tokens, mask), hf_logits(src, tokens, mask), mask)
    assert diff <= 1e-4


def test_bfloat16_load_and_export(batch, tmp_path):
    tokens, mask = batch
    src = save_tiny_hf_model("llama3", str(tmp_path / "src"))
    model = from_hf(src, dtype=jnp.bfloat16, compute_dtype="bfloat16", attention="xla")
    assert model.params["layers"]["attn"]["q"].dtype == jnp.bfloat16
    logits = _ours(model, tokens, mask)
    assert logits.dtype == np.float32
    diff = _max_diff_on_valid(logits, hf_logits(src, tokens, mask), mask)
    assert diff < 0.1, f"bfloat16 logits drifted by {diff}"
    to_hf(model, str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == jnp.bfloat16


# (the text decoders; the image-text `_vlm` presets are counted in test_transformer.py)
GEMMA_PRESETS = [n for n in sorted(PRESETS) if n.startswith("gemma") and not n.endswith("_vlm")]


def test_gemma_presets_are_their_hf_configs():
    """Each full-size Gemma preset written as HF config.json reads back as itself, and
    transformers builds from it (on the meta device: nothing allocated) a model with our
    parameter count; Gemma 2 2B is transformers' own Gemma2Config default."""
    import torch
    import transformers

    assert len(GEMMA_PRESETS) == 7
    for name in GEMMA_PRESETS:
        preset = PRESETS[name]
        hf = config_to_hf(preset, "bfloat16")
        assert config_from_hf(hf, name=name, compute_dtype="bfloat16") == preset, name
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**hf)
            )
        ours = sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(preset)))
        assert sum(p.numel() for p in model.parameters()) == ours, name
    default = transformers.Gemma2Config().to_dict()
    assert (
        config_from_hf(default, name="gemma2_2b", compute_dtype="bfloat16") == PRESETS["gemma2_2b"]
    )


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def good_dir(tmp_path):
    return save_tiny_hf_model("llama3", str(tmp_path / "model"))


def _reshard(path, tmp_path):
    """Turns a single-file checkpoint into two shards with an index."""
    model = from_hf(path)
    out = str(tmp_path / "two_shards")
    to_hf(model, out, max_shard_bytes=200_000)
    return out


def test_missing_shard_is_named(good_dir, tmp_path):
    path = _reshard(good_dir, tmp_path)
    shard = sorted(f for f in os.listdir(path) if f.startswith("model-"))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(HFFormatError, match=f"{shard}.*missing"):
        from_hf(path)


def test_unsupported_model_type(good_dir):
    config = json.load(open(os.path.join(good_dir, "config.json")))
    config["model_type"] = "gpt2"
    json.dump(config, open(os.path.join(good_dir, "config.json"), "w"))
    with pytest.raises(HFFormatError, match="model_type 'gpt2' is not supported.*llama"):
        from_hf(good_dir)


def test_wrong_tensor_shape_names_tensor_and_expectation(good_dir):
    file = os.path.join(good_dir, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-8]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match=r"k_proj.weight.*shape \(24, 64\).*implies \(32, 64\)"):
        from_hf(good_dir)


def test_missing_tensor_and_missing_files(good_dir, tmp_path):
    file = os.path.join(good_dir, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(HFFormatError, match="'model.norm.weight' is missing"):
        from_hf(good_dir)
    os.remove(file)
    with pytest.raises(HFFormatError, match="no \\*.safetensors file"):
        from_hf(good_dir)
    shutil.rmtree(good_dir)
    with pytest.raises(HFFormatError, match="does not exist"):
        from_hf(good_dir)


def test_corrupt_config_json(good_dir):
    with open(os.path.join(good_dir, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(HFFormatError, match="config.json is not valid JSON"):
        from_hf(good_dir)
