"""Adapters: their table, zero-B identity, merging, and HF / PEFT export of the result."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.lora import (
    LoRAConfig,
    adapter_kwargs,
    adapter_specs,
    init_adapters,
    merge,
    save_peft,
    target_paths,
    wrap,
)
from posttrain.models import Transformer, forward, from_hf, get_preset, to_hf
from posttrain.testing import hf_logits, save_tiny_hf_model

TOKENS = np.random.RandomState(0).randint(0, 256, (2, 12)).astype(np.int32)


def _with_random_b(adapters, seed=1):
    """Adapters whose B is non-zero (as after training)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [
        0.05 * jax.random.normal(k, x.shape) if path[-1].key == "b" else x
        for k, (path, x) in zip(keys, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def test_adapter_shapes_follow_the_contraction_layout():
    config = get_preset("tiny")  # D 64, N 8, K 4, H 16, F 128, T 2
    specs = adapter_specs(config, LoRAConfig(rank=4))
    attn, mlp = specs["layers"]["attn"], specs["layers"]["mlp"]
    assert attn["q"]["a"].shape == (2, 4, 64) and attn["q"]["b"].shape == (2, 4, 8, 16)
    assert attn["o"]["a"].shape == (2, 4, 8, 16) and attn["o"]["b"].shape == (2, 4, 64)
    assert mlp["down"]["a"].shape == (2, 4, 128) and mlp["down"]["b"].shape == (2, 4, 64)
    assert attn["q"]["a"].axes == ("layers", None, "embed")
    assert attn["q"]["b"].axes == ("layers", None, "heads", "head_dim")


def test_targets_select_by_path_and_bad_targets_are_clear():
    moe = get_preset("tiny_mla_moe")
    paths = target_paths(moe, LoRAConfig(targets=("moe/experts/(gate|up|down)$", "kv_b$")))
    assert ("layers", "moe", "experts", "up") in paths
    assert ("layers", "attn", "kv_b") in paths and ("dense_layers", "attn", "kv_b") in paths
    a = adapter_specs(moe, LoRAConfig(targets=("moe/experts/up$",)))["layers"]["moe"]
    assert a["experts"]["up"]["a"].axes[:2] == ("layers", "experts")
    with pytest.raises(ConfigError, match="match no layer weight"):
        target_paths(get_preset("tiny"), LoRAConfig(targets=("nothing",)))
    with pytest.raises(ConfigError, match="dropout"):
        LoRAConfig(dropout=0.1)
    with pytest.raises(ConfigError, match="lora.quantize='nf3'"):
        LoRAConfig(quantize="nf3")
    with pytest.raises(ConfigError, match="set lora.enabled=True"):
        LoRAConfig.from_config({"enabled": False, "quantize": "nf4"})
    assert LoRAConfig.from_config({"enabled": False, "rank": 4}) is None


@pytest.mark.parametrize(  # the MLA/MoE variant (~40 s) in `make test-slow`
    "preset", ["tiny", "tiny_moe", pytest.param("tiny_mla_moe", marks=pytest.mark.slow)]
)
def test_zero_b_gives_the_base_outputs_bit_for_bit(preset):
    config = get_preset(preset)
    lora = LoRAConfig(targets=(".",))  # every layer matrix, experts included
    params = Transformer.init(config, 0).params
    adapters = init_adapters(config, lora, jax.random.key(1))
    tokens = jnp.asarray(TOKENS % config.vocab_size)
    base = jax.jit(lambda p: forward(p, tokens, config))(params)
    wrapped = jax.jit(lambda p, a: forward(p, tokens, config, **adapter_kwargs(lora, a)))(
        params, adapters
    )
    np.testing.assert_array_equal(np.asarray(wrapped), np.asarray(base))


@pytest.mark.parametrize(
    "preset", ["tiny", pytest.param("tiny_mla_moe", marks=pytest.mark.slow)]
)  # MLA/MoE adapters: the zero-B test above; this one ~55 s
def test_merged_params_equal_the_wrapped_forward(preset):
    config = get_preset(preset)
    lora = LoRAConfig(targets=(".",), rank=4, alpha=8.0)
    params = Transformer.init(config, 0).params
    adapters = _with_random_b(init_adapters(config, lora, jax.random.key(1)))
    tokens = jnp.asarray(TOKENS % config.vocab_size)
    wrapped = forward(params, tokens, config, **adapter_kwargs(lora, adapters))
    merged = forward(merge(params, adapters, lora), tokens, config)
    assert float(jnp.max(jnp.abs(wrapped - forward(params, tokens, config)))) > 1e-3
    np.testing.assert_allclose(np.asarray(merged), np.asarray(wrapped), atol=1e-5)


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory):
    """A tiny HF Llama with adapters trained a few SGD steps (so B != 0)."""
    base_dir = save_tiny_hf_model("llama3", str(tmp_path_factory.mktemp("base")))
    model = from_hf(base_dir)
    lora = LoRAConfig(rank=4, alpha=8.0)
    adapters = init_adapters(model.config, lora, jax.random.key(0))
    tokens = jnp.asarray(TOKENS)

    def loss(a):
        logits = forward(model.params, tokens[:, :-1], model.config, **adapter_kwargs(lora, a))
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    grad = jax.jit(jax.value_and_grad(loss))
    losses = []
    for _ in range(5):
        value, g = grad(adapters)
        losses.append(float(value))
        adapters = jax.tree.map(lambda x, d: x - 0.5 * d, adapters, g)
    assert losses[-1] < losses[0]
    b = adapters["layers"]["attn"]["q"]["b"]
    assert float(jnp.max(jnp.abs(b))) > 0
    logits = forward(model.params, tokens, model.config, **adapter_kwargs(lora, adapters))
    return base_dir, model, adapters, lora, np.asarray(logits)


def test_merged_export_loads_in_transformers_with_the_same_logits(trained_llama, tmp_path):
    _, model, adapters, lora, logits = trained_llama
    merged = Transformer(merge(model.params, adapters, lora), model.config)
    to_hf(merged, str(tmp_path))
    np.testing.assert_allclose(hf_logits(str(tmp_path), TOKENS), logits, atol=1e-4)


def test_peft_layout_loads_in_peft_with_the_same_logits(trained_llama, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    base_dir, model, adapters, lora, logits = trained_llama
    save_peft(model.config, adapters, lora, str(tmp_path), base_model=base_dir)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    assert tensors[name.format("A")].shape == (4, 64)  # [r, in]
    assert tensors[name.format("B")].shape == (64, 4)  # [out = N * H, r]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, attn_implementation="eager", dtype=torch.float32
    )
    wrapped = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    with torch.no_grad():
        out = wrapped(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(out, logits, atol=1e-4)


def test_vision_encoder_adapters_are_opt_in_and_merge_like_the_wrapped_forward():
    """A VLM's image encoder takes adapters only when a target names its weights ("vision/
    layers/..."); wrapped (merged into the tower up front) and merged-for-export forwards agree,
    and the adapters move what the image tokens carry, so they get gradients."""
    config = get_preset("tiny_vlm")
    assert all(path[0] != "vision" for path in target_paths(config, LoRAConfig()))
    lora = LoRAConfig(targets=("attn/(q|v)$", "vision/layers/(q|o|fc1)$"), rank=4, alpha=8.0)
    vision_paths = [p for p in target_paths(config, lora) if p[0] == "vision"]
    assert vision_paths == [("vision", "layers", n) for n in ("q", "o", "fc1")]
    params = Transformer.init(config, 0).params
    adapters = _with_random_b(init_adapters(config, lora, jax.random.key(1)))
    v = config.vision
    tokens = np.array(TOKENS % config.vocab_size)
    tokens[:, 1 : 1 + v.tokens_per_image] = v.image_token_id
    images = jax.random.normal(jax.random.key(2), (2, 1, v.image_size, v.image_size, 3))

    def run(p, a):
        model_params, kwargs = wrap(lora, p, a)
        return forward(model_params, jnp.asarray(tokens), config, images_BIHWC=images, **kwargs)

    base = forward(params, jnp.asarray(tokens), config, images_BIHWC=images)
    merged = forward(merge(params, adapters, lora), jnp.asarray(tokens), config,
                     images_BIHWC=images)  # fmt: skip
    np.testing.assert_allclose(np.asarray(merged), np.asarray(run(params, adapters)), atol=1e-5)
    tower_only = run(params, {"vision": adapters["vision"]})
    assert float(jnp.max(jnp.abs(tower_only - base))) > 1e-3
    grads = jax.grad(lambda a: jnp.sum(run(params, a) ** 2))(adapters)
    assert float(jnp.max(jnp.abs(grads["vision"]["layers"]["q"]["a"]))) > 0
    with pytest.raises(ValueError, match="export merged"):
        save_peft(config, adapters, lora, "/nonexistent")
