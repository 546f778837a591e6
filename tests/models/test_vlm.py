"""VLMs (Gemma 3 image-text, LLaVA with SigLIP): logits equal transformers' with several images
per row and text only, the export round-trips, and sharded loss and gradients equal one
device's."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.models import HFFormatError, from_hf, to_hf
from posttrain.parallel import MeshConfig, make_mesh
from posttrain.sampling import generate, generate_continuous
from posttrain.testing import HF_VLMS, IMAGE_TOKEN, hf_vlm_logits, save_tiny_hf_vlm
from tests.sampling.reference import generate_static


@pytest.fixture(scope="module", params=sorted(HF_VLMS))
def vlm_dir(request, tmp_path_factory):
    return save_tiny_hf_vlm(request.param, str(tmp_path_factory.mktemp(request.param)))


def _batch(tokens_per_image: int, seed: int = 0):
    """Two right-padded rows: text, image, text, image, text; and text, image, text. Returns
    tokens, mask, the three images in row order (HF's pixel_values) and ours per row."""
    rng = np.random.RandomState(seed)

    def row(parts):
        out = []
        for p in parts:
            out += [IMAGE_TOKEN] * tokens_per_image if p == "I" else list(rng.randint(1, 240, p))
        return out

    rows = [row([3, "I", 2, "I", 3]), row([2, "I", 4])]
    L = len(rows[0])
    tokens, mask = np.zeros((2, L), np.int32), np.zeros((2, L), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, 1
    pixels = rng.randn(3, 32, 32, 3).astype(np.float32)
    per_row = np.zeros((2, 2, 32, 32, 3), np.float32)
    per_row[0], per_row[1, 0] = pixels[:2], pixels[2]
    return tokens, mask, pixels, per_row


def _logits(model, tokens, mask, images=None):
    fn = jax.jit(lambda m, t, s, i: m(t, segment_ids_BL=s, images=i))
    return np.asarray(fn(model, jnp.asarray(tokens), jnp.asarray(mask), images))


def _max_on_valid(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


def test_logits_match_transformers_with_images_and_without(vlm_dir):
    model = from_hf(vlm_dir, attention="xla")
    tokens, mask, pixels, per_row = _batch(model.config.vision.tokens_per_image)
    ours = _logits(model, tokens, mask, jnp.asarray(per_row))
    assert _max_on_valid(ours, hf_vlm_logits(vlm_dir, tokens, mask, pixels), mask) <= 1e-4
    # each image lands on its own placeholders: swapping a row's two images changes the logits
    swapped = _logits(model, tokens, mask, jnp.asarray(per_row[:, ::-1]))
    assert _max_on_valid(swapped, ours, mask) > 1e-2
    v = model.config.vision
    if v.bidirectional:  # Gemma 3: an image's tokens see each other both ways, as HF's do
        causal = dataclasses.replace(v, bidirectional=False)
        causal = type(model)(model.params, model.config.replace(vision=causal))
        ref = hf_vlm_logits(vlm_dir, tokens, mask, pixels)
        assert _max_on_valid(_logits(causal, tokens, mask, jnp.asarray(per_row)), ref, mask) > 1e-2
    text = np.random.RandomState(1).randint(1, 240, (2, 12)).astype(np.int32)
    ones = np.ones_like(text)
    assert (
        _max_on_valid(_logits(model, text, ones), hf_vlm_logits(vlm_dir, text, ones, None), ones)
        <= 1e-4
    )


# The tiny LLaVA's tensors its model does not run: the last of 3 encoder layers (it reads the
# next-to-last), SigLIP's pooling head and post_layernorm.
UNUSED = tuple(f"vision_tower.{p}" for p in ("encoder.layers.2.", "head.", "post_layernorm."))


def _tensors(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _load_report(path) -> dict:
    """transformers' loading info for the export at `path` (every list empty: it found each
    weight it expects, and nothing else)."""
    import transformers

    _, info = transformers.AutoModelForImageTextToText.from_pretrained(
        str(path), output_loading_info=True
    )
    return {k: sorted(v) for k, v in info.items() if k != "error_msgs"}


_NO_SURPRISES = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}


def _encoder(config: dict) -> tuple:
    """What of a VLM config.json decides which encoder tensors exist and which one is read."""
    v = config["vision_config"]
    return v["num_hidden_layers"], v.get("vision_use_head"), config.get("vision_feature_layer")


def test_export_round_trip(vlm_dir, tmp_path):
    """The export holds every tensor of the directory the model came from, byte for byte (the
    encoder's layers past LLaVA's feature layer, its pooling head and post_layernorm
    included), under a config.json with the same encoder; transformers finds every weight."""
    model = from_hf(vlm_dir, attention="xla")
    to_hf(model, str(tmp_path), source=vlm_dir)
    original = json.load(open(f"{vlm_dir}/config.json"))
    exported = json.load(open(tmp_path / "config.json"))
    assert exported["model_type"] == original["model_type"]
    assert _encoder(exported) == _encoder(original)
    assert _load_report(tmp_path) == _NO_SURPRISES
    source, out = _tensors(vlm_dir), _tensors(tmp_path)
    assert sorted(out) == sorted(source)
    assert [n for n in source if out[n].tobytes() != source[n].tobytes()] == []
    tokens, mask, pixels, _ = _batch(model.config.vision.tokens_per_image)
    diff = _max_on_valid(
        hf_vlm_logits(str(tmp_path), tokens, mask, pixels),
        hf_vlm_logits(vlm_dir, tokens, mask, pixels),
        mask,
    )
    assert diff <= 1e-5
    again = from_hf(str(tmp_path), attention="xla")
    assert again.config.vision == model.config.vision


def _save_run(workdir, model, hf_path: str) -> None:
    """What a run that started from `hf_path` leaves: a checkpoint of `model` and config.json."""
    from posttrain.train import CheckpointConfig, Checkpointer

    config = {"model": {"hf_path": hf_path, "checkpoint": ""}}
    model_config = json.loads(json.dumps(dataclasses.asdict(model.config), default=str))
    checkpointer = Checkpointer(str(workdir), CheckpointConfig(async_save=False))
    extra = {"config": config, "model_config": model_config}
    checkpointer.save(3, {"params": model.params}, extra=extra, force=True)
    checkpointer.close()
    (workdir / "config.json").write_text(json.dumps(config))


def test_a_trained_checkpoint_exported_later_carries_the_unused_tensors(tmp_path, capsys):
    """A run's checkpoint (LLaVA, every weight changed by "training") exported by the CLI: the
    tensors the model does not run come from the run's model.hf_path byte for byte, the trained
    ones from the checkpoint; with that directory gone the export is refused with the reason,
    and --source names a copy."""
    from posttrain import cli

    source = save_tiny_hf_vlm("llava", str(tmp_path / "llava"))
    loaded = from_hf(source)
    trained = type(loaded)(jax.tree.map(lambda x: x + 0.01, loaded.params), loaded.config)
    _save_run(tmp_path / "run", trained, source)
    out = tmp_path / "hf"
    assert cli.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={out}"]) == 0
    assert _load_report(out) == _NO_SURPRISES
    assert _encoder(json.load(open(out / "config.json"))) == (3, True, -2)
    theirs, ours = _tensors(source), _tensors(out)
    assert sorted(ours) == sorted(theirs)
    kept = sorted(n for n in theirs if ours[n].tobytes() == theirs[n].tobytes())
    assert kept == sorted(n for n in theirs if n.startswith(UNUSED)), kept  # 29 of 89
    exported = from_hf(str(out)).params
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(trained.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # a run that started from that run's checkpoint (e.g. DPO after SFT): the same source
    (tmp_path / "dpo").mkdir()
    (tmp_path / "dpo" / "config.json").write_text(
        json.dumps({"model": {"hf_path": "", "checkpoint": str(tmp_path / "run")}})
    )
    shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "dpo" / "checkpoints")
    assert (
        cli.main(["export", f"--workdir={tmp_path / 'dpo'}", f"--out={tmp_path / 'dpo_hf'}"]) == 0
    )
    assert _tensors(tmp_path / "dpo_hf").keys() == ours.keys()
    assert (tmp_path / "dpo_hf" / "model.safetensors").read_bytes() == (
        out / "model.safetensors"
    ).read_bytes()

    moved = shutil.move(source, tmp_path / "moved")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    capsys.readouterr()
    assert cli.main(["export", f"--workdir={tmp_path / 'run'}", f"--out={out}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"posttrain export: {source}, the HF directory the model was loaded from, does not "
        f"exist: the export carries its encoder tensors that model 'llava' does not run; "
        "restore it or name a copy of it (--source=DIR, to_hf(source=...))"
    ), err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # untouched
    again = tmp_path / "again"
    argv = ["export", f"--workdir={tmp_path / 'run'}", f"--out={again}", f"--source={moved}"]
    assert cli.main(argv) == 0
    assert (again / "model.safetensors").read_bytes() == before["model.safetensors"]


def test_a_gemma3_pooling_head_is_carried(tmp_path):
    """Gemma 3 with `vision_use_head`: the head its model does not run is exported unchanged."""
    name, kwargs = HF_VLMS["gemma3"]
    kwargs = dict(kwargs, vision_config=dict(kwargs["vision_config"], vision_use_head=True))
    with pytest.MonkeyPatch.context() as m:
        m.setitem(HF_VLMS, "gemma3_head", (name, kwargs))
        source = save_tiny_hf_vlm("gemma3_head", str(tmp_path / "src"))
    to_hf(from_hf(source), str(tmp_path / "out"), source=source)
    assert _load_report(tmp_path / "out") == _NO_SURPRISES
    theirs, ours = _tensors(source), _tensors(tmp_path / "out")
    assert any(n.startswith("vision_tower.head.") for n in theirs)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[n].tobytes() == theirs[n].tobytes() for n in theirs)


def test_vlm_exports_refuse_what_would_drop_tensors(tmp_path):
    """Without a source a VLM export is refused, and so is a source of another model; a preset
    (source='') gets LLaVA's unused post_layernorm at LayerNorm's init and loads whole."""
    from posttrain.errors import UserError
    from posttrain.models import Transformer, get_preset

    llava = save_tiny_hf_vlm("llava", str(tmp_path / "llava"))
    gemma = save_tiny_hf_vlm("gemma3", str(tmp_path / "gemma3"))
    model = from_hf(llava)
    with pytest.raises(ValueError, match="is a VLM: pass source="):
        to_hf(model, str(tmp_path / "out"))
    with pytest.raises(UserError, match=f"{gemma} holds another model than 'llava'"):
        to_hf(model, str(tmp_path / "out"), source=gemma)
    assert not (tmp_path / "out").exists()

    preset = Transformer.init(get_preset("tiny_vlm"), 0)
    to_hf(preset, str(tmp_path / "preset"), source="")
    assert _load_report(tmp_path / "preset") == _NO_SURPRISES
    norm = {k: v for k, v in _tensors(tmp_path / "preset").items() if "post_layernorm" in k}
    assert sorted(norm) == [
        "vision_tower.post_layernorm.bias",
        "vision_tower.post_layernorm.weight",
    ]
    assert (norm["vision_tower.post_layernorm.weight"] == 1).all()
    assert (norm["vision_tower.post_layernorm.bias"] == 0).all()


def test_sharded_loss_and_gradients_equal_one_device(vlm_dir, devices):
    """Cross-entropy on the text tokens of four rows with images, and its gradient for every
    weight (encoder and projector included), on fsdp 4 x tensor 2 = one device."""
    model = from_hf(vlm_dir, attention="xla")
    tokens, mask, _, per_row = _batch(model.config.vision.tokens_per_image)
    tokens, mask = np.tile(tokens, (2, 1)), np.tile(mask, (2, 1))
    per_row = np.concatenate([per_row, per_row[:, ::-1]])
    targets = np.roll(tokens, -1, axis=1)
    weights = (mask * np.roll(mask, -1, axis=1) * (targets != IMAGE_TOKEN)).astype(np.float32)
    batch = tuple(map(jnp.asarray, (tokens, mask, per_row, targets, weights)))

    def loss(params, tokens, mask, images, targets, weights):
        logits = type(model)(params, model.config)(tokens, segment_ids_BL=mask, images=images)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        return (nll * weights).sum() / weights.sum()

    grad = jax.jit(jax.value_and_grad(loss))
    value, grads = grad(model.params, *batch)
    mesh = make_mesh(MeshConfig.from_dict({"fsdp": 4, "tensor": 2}))
    params = from_hf(vlm_dir, mesh=mesh, attention="xla").params
    with jax.set_mesh(mesh):
        q = params["vision"]["layers"]["q"]  # [T, W, N, H]: W over fsdp, N over tensor
        assert q.sharding.shard_shape(q.shape) == (q.shape[0], 8, 2, 8)
        rows = NamedSharding(mesh, PartitionSpec("fsdp"))
        sharded_value, sharded_grads = grad(params, *jax.device_put(batch, rows))
    np.testing.assert_allclose(float(sharded_value), float(value), rtol=1e-5)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(sharded_grads), strict=True):
        np.testing.assert_allclose(np.asarray(s), np.asarray(g), rtol=1e-4, atol=1e-6)


def test_bad_vlm_configs_are_named(vlm_dir, tmp_path):
    config = json.load(open(f"{vlm_dir}/config.json"))
    bad = dict(config, vision_config=dict(config["vision_config"], model_type="clip_vision_model"))
    (tmp_path / "config.json").write_text(json.dumps(bad))
    for f in ("model.safetensors",):
        (tmp_path / f).symlink_to(f"{vlm_dir}/{f}")
    with pytest.raises(HFFormatError, match="clip_vision_model.*not supported"):
        from_hf(str(tmp_path))


def _hf_greedy_with_images(path, prompts, pixels, max_new_tokens):
    import torch
    import transformers

    hf = transformers.AutoModelForImageTextToText.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts]),
        pixel_values=torch.tensor(pixels).permute(0, 3, 1, 2).float(),
    )
    if hf.config.model_type == "gemma3":
        kwargs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    out = hf.generate(
        **kwargs,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=0,
        eos_token_id=None,
    )
    return [tuple(row[L:].tolist()) for row in out]


def test_greedy_generation_with_images_matches_hf_generate(vlm_dir):
    model = from_hf(vlm_dir, attention="xla")
    tokens, mask, pixels, per_row = _batch(model.config.vision.tokens_per_image)
    prompts = [[int(t) for t in row[m.astype(bool)]] for row, m in zip(tokens, mask, strict=True)]
    images = [list(per_row[0]), [per_row[1, 0]]]
    ours = generate(model, None, prompts, max_new_tokens=8, length_bucket=4, images=images)
    expected = _hf_greedy_with_images(vlm_dir, prompts, pixels, 8)
    assert [row[0].token_ids for row in ours] == expected
    # the images steer the text: without them (placeholders embedded as tokens) it differs
    blind = generate(model, None, prompts, max_new_tokens=8, length_bucket=4)
    assert [row[0].token_ids for row in blind] != expected
    # the paged engine prefills the images too (Gemma 3's bidirectional blocks over its pool)
    paged = generate_continuous(
        model, None, prompts, max_new_tokens=8, length_bucket=4, block_size=4, images=images
    )
    assert [row[0].token_ids for row in paged] == expected


def test_engine_samples_a_group_from_one_prefill_with_images(vlm_dir):
    """A GRPO group's samples share their prompt's prefill, images included, and draw what the
    static sampler draws with the same seeds."""
    model = from_hf(vlm_dir, attention="xla")
    tokens, mask, _, per_row = _batch(model.config.vision.tokens_per_image)
    prompts = [[int(t) for t in row[m.astype(bool)]] for row, m in zip(tokens, mask, strict=True)]
    images = [list(per_row[0]), [per_row[1, 0]]]
    kwargs = dict(max_new_tokens=6, n=3, temperature=1.0, seeds=[5, 6], images=images)
    stats = {}
    paged = generate_continuous(model, None, prompts, block_size=4, stats=stats, **kwargs)
    static = generate_static(model, None, prompts, **kwargs)
    assert [[c.token_ids for c in row] for row in paged] == [
        [c.token_ids for c in row] for row in static
    ]
    assert len({c.token_ids for row in paged for c in row}) > 2  # (really sampled)
    assert stats["prompt_tokens"] == 3 * stats["prefill_tokens"] == 3 * sum(map(len, prompts))


def test_encoder_attention_over_many_patches_goes_in_query_chunks():
    """Gemma 3's 4096 patches: the queries are scored 512 at a time (the memory of one chunk's
    scores), giving what one softmax over all of them gives."""
    from posttrain.models._vision import _full_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, 1024, 2, 8), jnp.float32) for i in range(3))
    chunked = _full_attention(q, k, v, 8**-0.5, jnp.float32)
    scores = jnp.einsum("IPNH,IQNH->INPQ", q, k) * 8**-0.5
    whole = jnp.einsum("INPQ,IQNH->IPNH", jax.nn.softmax(scores, axis=-1), v)
    np.testing.assert_allclose(chunked, whole, atol=1e-6)
    lowered = jax.jit(lambda q: _full_attention(q, k, v, 1.0, jnp.float32)).lower(q).as_text()
    assert "1024x1024" not in lowered and "512x1024" in lowered
