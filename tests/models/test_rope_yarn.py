"""YaRN RoPE (DeepSeek-V3, Kimi K2) against transformers' own functions, config.json in and out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from posttrain.models import from_hf, to_hf
from posttrain.models._components import RopeScaling
from posttrain.models._config import ModelConfig
from posttrain.models._hf_config import config_from_hf, config_to_hf
from posttrain.models._hf_rope import _rope_from_hf
from posttrain.models._rope import inverse_frequencies, rope_angles, rope_attention_factor
from posttrain.testing import hf_logits, save_tiny_hf_model

# (rope_scaling as a config.json writes it, max_position_embeddings, rope_theta)
YARN_CASES = {
    # DeepSeek-V3's config.json, legacy "type" key; mscale == mscale_all_dim, so the factor is 1.
    "deepseek_v3": (
        {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        163840,
        10000.0,
    ),
    # Kimi K2: beta_fast == beta_slow, HF's zero-width ramp guard.
    "kimi_k2": (
        {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        131072,
        50000.0,
    ),
    # mscale != mscale_all_dim: attention_factor = m(mscale) / m(mscale_all_dim).
    "mscale": (
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 2048,
        },
        32768,
        10000.0,
    ),
    # Given attention_factor, untruncated ramp, non-default betas.
    "attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "attention_factor": 1.3,
            "truncate": False,
            "beta_fast": 16,
            "beta_slow": 2,
            "original_max_position_embeddings": 1024,
        },
        4096,
        500000.0,
    ),
    # Qwen-style: no mscale, so attention_factor = 0.1 ln(factor) + 1.
    "plain": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        131072,
        1000000.0,
    ),
    # No factor: HF derives it as max_position_embeddings / original.
    "derived_factor": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 512},
        8192,
        10000.0,
    ),
}

POSITIONS = np.array([[0, 1, 2, 17, 511, 4095], [4096, 4097, 8191, 20000, 65535, 131071]])


def _hf_llama(case, head_dim):
    rope, max_len, theta = YARN_CASES[case]
    return transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_len,
        rope_theta=theta,
        rope_scaling=dict(rope),
    )


def _hf_deepseek(case):
    rope, max_len, theta = YARN_CASES[case]
    return transformers.DeepseekV3Config(
        qk_rope_head_dim=64,
        max_position_embeddings=max_len,
        rope_theta=theta,
        rope_scaling=dict(rope),
    )


def _ours_from_llama(hf_config):
    return config_from_hf(hf_config.to_dict())


def _ours_from_deepseek(hf_config):
    # The rotary part of an MLA head is qk_rope_head_dim wide; HF calls it head_dim.
    theta, scaling = _rope_from_hf(hf_config.to_dict())
    return ModelConfig(
        vocab_size=16,
        embed_dim=64,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=hf_config.head_dim,
        mlp_dim=16,
        max_seq_len=hf_config.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=scaling,
    )


def _pairs():
    for case in YARN_CASES:
        for head_dim in (64, 128):
            yield pytest.param((case, "llama", head_dim), id=f"{case}-llama-h{head_dim}")
        yield pytest.param((case, "deepseek_v3", 64), id=f"{case}-deepseek_v3")


@pytest.fixture(params=list(_pairs()))
def hf_and_ours(request):
    case, arch, head_dim = request.param
    if arch == "llama":
        hf_config = _hf_llama(case, head_dim)
        return hf_config, _ours_from_llama(hf_config), LlamaRotaryEmbedding
    hf_config = _hf_deepseek(case)
    return hf_config, _ours_from_deepseek(hf_config), DeepseekV3RotaryEmbedding


def test_inverse_frequencies_and_attention_factor_match_hf(hf_and_ours):
    hf_config, ours, _ = hf_and_ours
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert ours.rope_scaling.rope_type == "yarn"
    inv_freq = inverse_frequencies(ours)
    assert inv_freq.dtype == np.float32
    np.testing.assert_allclose(inv_freq, hf_inv_freq.numpy(), rtol=1e-6, atol=0)
    # torch's float32 pow itself varies by an ulp between its vector and scalar kernels.
    np.testing.assert_array_max_ulp(inv_freq, hf_inv_freq.numpy(), maxulp=1)
    assert rope_attention_factor(ours) == pytest.approx(hf_factor, rel=1e-12)


def test_rope_angles_match_hf_rotary_embedding(hf_and_ours):
    hf_config, ours, rotary_class = hf_and_ours
    rotary = rotary_class(hf_config)
    with torch.no_grad():
        x = torch.zeros(1, dtype=torch.float32)
        hf_cos, hf_sin = rotary(x, torch.tensor(POSITIONS))
    cos, sin = jax.jit(rope_angles, static_argnums=1)(jnp.asarray(POSITIONS), ours)
    half = cos.shape[-1]
    # 1e-6 wherever the frequencies agree bitwise. Where torch's pow rounded a frequency the
    # other way (an ulp, see above), the angle moves by position * that ulp, which at 1e5
    # positions is far more than 1e-6; allow exactly that much there.
    inv_hf = rotary.inv_freq.numpy()
    delta = np.abs(inverse_frequencies(ours) - inv_hf)
    angles = POSITIONS[..., None].astype(np.float32) * inv_hf
    slack = rope_attention_factor(ours) * (POSITIONS[..., None] * delta + np.spacing(angles))
    tol = 1e-6 + np.where(delta > 0, slack, 0)
    for ours_x, hf_x in ((cos, hf_cos.numpy()), (sin, hf_sin.numpy())):
        np.testing.assert_array_equal(hf_x[..., :half], hf_x[..., half:])  # rotate-half layout
        assert np.all(np.abs(np.asarray(ours_x) - hf_x[..., :half]) <= tol)


def test_deepseek_v3_config_json_loads_exactly():
    rope, max_len, theta = YARN_CASES["deepseek_v3"]
    hf = {"rope_scaling": {**rope, "an_unknown_key": 3}, "max_position_embeddings": max_len}
    assert _rope_from_hf({**hf, "rope_theta": theta}) == (
        theta,
        RopeScaling(
            rope_type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )


def test_hf_defaults_and_quirks_when_loading():
    base = {"max_position_embeddings": 8192}
    # transformers 5's rope_parameters, with theta inside; nulls mean HF's defaults.
    theta, s = _rope_from_hf(
        {
            **base,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": None,
                "beta_fast": None,
                "beta_slow": 0,
                "original_max_position_embeddings": 1024,
            },
        }
    )
    assert theta == 1e6
    assert (s.factor, s.beta_fast, s.beta_slow, s.truncate) == (8.0, 32.0, 1.0, True)
    assert s.mscale is None and s.attention_factor is None
    # HF reads `truncate` by truth, so null turns truncation off.
    _, s = _rope_from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 2, "truncate": None}})
    assert s.truncate is False
    # No original in the rope dict: max_position_embeddings; a top-level one wins over both.
    assert s.original_max_position_embeddings == 8192
    _, s = _rope_from_hf(
        {
            **base,
            "original_max_position_embeddings": 2048,
            "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 16},
        }
    )
    assert s.original_max_position_embeddings == 2048


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_config_round_trip(case):
    rope, max_len, theta = YARN_CASES[case]
    hf = _hf_llama(case, 64).to_dict()
    cfg = config_from_hf(hf)
    exported = config_to_hf(cfg, "float32")
    assert config_from_hf(exported).rope_scaling == cfg.rope_scaling
    written = exported["rope_scaling"]
    assert written["rope_type"] == "yarn" and None not in written.values()
    assert "low_freq_factor" not in written  # llama3's fields stay out of a yarn dict
    assert ("attention_factor" in written) == (rope.get("attention_factor") is not None)


def test_invalid_yarn_settings_are_named():
    with pytest.raises(ValueError, match="beta_slow"):
        RopeScaling(rope_type="yarn", factor=4.0, beta_slow=0)


# End to end: a tiny HF Llama with yarn, 64 positions past an original context of 16.
E2E_ROPE = {
    "default_betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "all_fields": {
        "type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 4,
        "beta_slow": 0.25,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    "attention_factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.25,
        "beta_fast": 8,
        "beta_slow": 0.5,
    },
}


@pytest.fixture(scope="module", params=sorted(E2E_ROPE))
def yarn_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"yarn_{request.param}"))
    rope = dict(E2E_ROPE[request.param])
    return save_tiny_hf_model("llama3", path, rope_scaling=rope, head_dim=16, rope_theta=100.0)


@pytest.fixture(scope="module")
def long_batch():
    lengths = (64, 40)
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 256, size=(len(lengths), max(lengths))).astype(np.int32)
    mask = (np.arange(max(lengths))[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return np.where(mask, tokens, 0), mask


def _logits(model, tokens, mask):
    fn = jax.jit(lambda m, t, s: m(t, segment_ids_BL=s))
    return np.asarray(fn(model, jnp.asarray(tokens), jnp.asarray(mask)))


def test_yarn_logits_match_transformers(yarn_dir, long_batch):
    tokens, mask = long_batch
    model = from_hf(yarn_dir, attention="xla")
    assert model.config.rope_scaling.rope_type == "yarn"
    valid = mask.astype(bool)
    diff = np.abs(_logits(model, tokens, mask) - hf_logits(yarn_dir, tokens, mask))[valid].max()
    assert diff <= 1e-4, f"max |logits - HF| = {diff}"


def test_yarn_export_loads_the_same_in_transformers(yarn_dir, long_batch, tmp_path):
    tokens, mask = long_batch
    to_hf(from_hf(yarn_dir, attention="xla"), str(tmp_path))
    valid = mask.astype(bool)
    ref = hf_logits(yarn_dir, tokens, mask)
    diff = np.abs(hf_logits(str(tmp_path), tokens, mask) - ref)[valid].max()
    assert diff <= 1e-5, f"exported model's logits differ from the original by {diff}"
