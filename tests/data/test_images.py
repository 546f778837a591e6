"""Image loading and preprocessing: the pixels equal transformers' own (PIL) image processors'
for Gemma 3 and SigLIP on odd sizes and modes, every kind of ref reads the same image, and
unreadable refs get one error naming them."""

import base64
import io

import numpy as np
import PIL.Image
import pytest
import transformers

from posttrain import paths
from posttrain.data._images import ImageError, load_image, preprocess_images
from posttrain.models import VisionConfig

SIDE = 28


def _vision(resample: str, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> VisionConfig:
    return VisionConfig(
        image_size=SIDE, patch_size=7, width=8, mlp_dim=8, num_layers=1, num_heads=1,
        tokens_per_image=4, image_token_id=5, resample=resample, image_mean=mean, image_std=std,
    )  # fmt: skip


def _images() -> list[PIL.Image.Image]:
    rng = np.random.default_rng(0)
    rgb = PIL.Image.fromarray(rng.integers(0, 256, (23, 37, 3), np.uint8))
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (40, 19, 4), np.uint8), "RGBA")
    grey = PIL.Image.fromarray(rng.integers(0, 256, (31, 31), np.uint8), "L")
    palette = rgb.convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=16)
    return [rgb, rgba, grey, palette]


@pytest.mark.parametrize(
    "processor, resample, mean, std",
    [
        ("Gemma3ImageProcessorPil", "bilinear", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ("SiglipImageProcessorPil", "bicubic", (0.48145466, 0.4578275, 0.40821073),
         (0.26862954, 0.26130258, 0.27577711)),
    ],
)  # fmt: skip
def test_pixels_equal_the_hf_image_processors(processor, resample, mean, std):
    cls = getattr(transformers, processor, None)
    if cls is None:  # (older transformers name the PIL processors without the suffix)
        cls = getattr(transformers, processor.removesuffix("Pil"))
    hf = cls(
        size={"height": SIDE, "width": SIDE}, resample={"bilinear": 2, "bicubic": 3}[resample],
        image_mean=list(mean), image_std=list(std), do_convert_rgb=True,
    )  # fmt: skip
    images = _images()
    expected = np.asarray(hf(images, return_tensors="np")["pixel_values"]).transpose(0, 2, 3, 1)
    ours = preprocess_images(images, _vision(resample, mean, std))
    assert ours.shape == (4, SIDE, SIDE, 3) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_every_ref_kind_reads_the_same_image(tmp_path, gcs_bucket):
    image = _images()[0]
    png = io.BytesIO()
    image.save(png, "PNG")
    data = png.getvalue()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    remote = paths.join(gcs_bucket, "images", "a.png")
    with paths.path(remote).open("wb") as f:
        f.write(data)
    refs = [
        ("sub/a.png", str(tmp_path)),
        (str(tmp_path / "sub" / "a.png"), None),
        (data, None),
        ("data:image/png;base64," + base64.b64encode(data).decode(), None),
        ({"bytes": data, "path": "ignored.png"}, None),
        ({"bytes": None, "path": "sub/a.png"}, str(tmp_path)),
        (remote, None),
        ("a.png", paths.join(gcs_bucket, "images")),
    ]
    want = np.asarray(image)
    for ref, root in refs:
        got = load_image(ref, root=root)
        np.testing.assert_array_equal(np.asarray(got.convert("RGB")), want, err_msg=str(ref)[:60])


def test_unreadable_refs_are_named(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    for ref, words in (
        (str(tmp_path / "missing.png"), "missing.png does not exist"),
        (str(tmp_path / "broken.png"), "broken.png cannot be decoded"),
        ("https://example.com/cat.png", "not fetched at training time"),
        (b"\x00\x01garbage", "cannot be decoded"),
        (42, "is a int"),
        ("data:image/png,abc", "base64"),
    ):
        with pytest.raises(ImageError, match=words):
            load_image(ref)
