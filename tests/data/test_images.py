"""Image loading and preprocessing: the pixels equal transformers' own (PIL) image processors'
for Gemma 3 and SigLIP on odd sizes and modes, a model directory's image processor config sets
the filter, mean and std, every kind of ref reads the same image, and unreadable refs get one
error naming them."""

import base64
import io
import json

import numpy as np
import PIL.Image
import pytest
import transformers

from posttrain import paths
from posttrain.data._images import ImageError, image_array, load_image, preprocess_images
from posttrain.models import VisionConfig
from posttrain.models._hf_vlm import with_image_processor

SIDE = 28
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _vision(resample: str, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> VisionConfig:
    return VisionConfig(
        image_size=SIDE, patch_size=7, width=8, mlp_dim=8, num_layers=1, num_heads=1,
        tokens_per_image=4, image_token_id=5, resample=resample, image_mean=mean, image_std=std,
    )  # fmt: skip


def _images() -> list[PIL.Image.Image]:
    """Odd sizes in every mode `convert_to_rgb` treats differently."""
    rng = np.random.default_rng(0)
    rgb = PIL.Image.fromarray(rng.integers(0, 256, (23, 37, 3), np.uint8))
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (40, 19, 4), np.uint8), "RGBA")
    grey = PIL.Image.fromarray(rng.integers(0, 256, (31, 31), np.uint8), "L")
    grey_alpha = PIL.Image.fromarray(rng.integers(0, 256, (17, 45, 2), np.uint8), "LA")
    palette = rgb.convert("P", palette=PIL.Image.Palette.ADAPTIVE, colors=16)
    see_through = palette.copy()
    see_through.info["transparency"] = 3  # one palette colour is transparent
    return [rgb, rgba, grey, grey_alpha, palette, see_through]


def _hf_processor(name: str, resample: int, mean, std):
    cls = getattr(transformers, name, None)
    if cls is None:  # (older transformers name the PIL processors without the suffix)
        cls = getattr(transformers, name.removesuffix("Pil"))
    extra = {"do_pan_and_scan": False} if name.startswith("Gemma3") else {}
    return cls(
        size={"height": SIDE, "width": SIDE}, resample=resample, image_mean=list(mean),
        image_std=list(std), do_convert_rgb=True, **extra,
    )  # fmt: skip


def _hf_pixels(processor, images) -> np.ndarray:
    return np.asarray(processor(images, return_tensors="np")["pixel_values"]).transpose(0, 2, 3, 1)


@pytest.mark.parametrize(
    "processor, resample, mean, std",
    [
        ("Gemma3ImageProcessorPil", "bilinear", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ("SiglipImageProcessorPil", "bicubic", CLIP_MEAN, CLIP_STD),
    ],
)
def test_pixels_equal_the_hf_image_processors(processor, resample, mean, std):
    hf = _hf_processor(processor, {"bilinear": 2, "bicubic": 3}[resample], mean, std)
    images, vision = _images(), _vision(resample, mean, std)
    ours = preprocess_images(images, vision)
    assert ours.shape == (len(images), SIDE, SIDE, 3) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, _hf_pixels(hf, images), atol=1e-5)
    np.testing.assert_array_equal(image_array(images[1], vision), ours[1])
    assert preprocess_images([], vision).shape == (0, SIDE, SIDE, 3)


def test_a_model_directorys_image_processor_config_sets_the_preprocessing(tmp_path):
    default = _vision("bilinear")
    hf = _hf_processor("SiglipImageProcessorPil", 3, CLIP_MEAN, CLIP_STD)
    hf.save_pretrained(tmp_path / "hub")  # preprocessor_config.json
    vision = with_image_processor(default, str(tmp_path / "hub"))
    assert (vision.resample, vision.image_mean, vision.image_std) == (
        "bicubic",
        CLIP_MEAN,
        CLIP_STD,
    )
    images = _images()
    np.testing.assert_allclose(preprocess_images(images, vision), _hf_pixels(hf, images), atol=1e-5)

    # transformers 5's Processor.save_pretrained nests it in processor_config.json
    (tmp_path / "v5").mkdir()
    nested = {"image_processor": {"resample": 3, "do_normalize": False}}
    (tmp_path / "v5" / "processor_config.json").write_text(json.dumps(nested))
    vision = with_image_processor(default, str(tmp_path / "v5"))
    assert (vision.resample, vision.image_mean, vision.image_std) == (
        "bicubic",
        (0.0,) * 3,
        (1.0,) * 3,
    )

    assert with_image_processor(default, str(tmp_path)) == default  # no config: as it was
    (tmp_path / "lanczos").mkdir()
    (tmp_path / "lanczos" / "preprocessor_config.json").write_text('{"resample": 1}')
    with pytest.raises(ValueError, match="lanczos/preprocessor_config.json: resample 1 is not"):
        with_image_processor(default, str(tmp_path / "lanczos"))


def test_every_ref_kind_reads_the_same_image(tmp_path, gcs_bucket, monkeypatch):
    image = _images()[0]
    png, jpeg = io.BytesIO(), io.BytesIO()
    image.save(png, "PNG")
    image.save(jpeg, "JPEG")
    data = png.getvalue()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(data)
    paths.write_bytes(paths.join(gcs_bucket, "images", "a.png"), data)
    monkeypatch.setenv("HOME", str(tmp_path))
    refs = [
        ("sub/a.png", str(tmp_path)),
        (str(tmp_path / "sub" / "a.png"), None),
        (str(tmp_path / "sub" / "a.png"), "/elsewhere"),  # absolute: the root is not used
        ("~/sub/a.png", None),
        (data, None),
        ("data:image/png;base64," + base64.b64encode(data).decode(), None),
        ({"bytes": data, "path": "ignored.png"}, None),
        ({"bytes": None, "path": "sub/a.png"}, str(tmp_path)),
        ({"url": str(tmp_path / "sub" / "a.png")}, None),
        (f"{gcs_bucket}/images/a.png", None),
        ("a.png", paths.join(gcs_bucket, "images")),
    ]
    want = np.asarray(image)
    for ref, root in refs:
        got = load_image(ref, root=root)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(ref)[:60])
    assert load_image(image) is image
    from_jpeg = load_image(jpeg.getvalue())  # lossy: the same as PIL's own decoding
    np.testing.assert_array_equal(np.asarray(from_jpeg), np.asarray(PIL.Image.open(jpeg)))
    vision = _vision("bicubic")
    np.testing.assert_array_equal(
        image_array("sub/a.png", vision, root=str(tmp_path)), preprocess_images([image], vision)[0]
    )


def test_exif_orientation_is_applied():
    image = _images()[0]  # 37 wide, 23 high
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # Orientation: stored rotated; shown turned 90 degrees clockwise
    jpeg = io.BytesIO()
    image.save(jpeg, "JPEG", exif=exif.tobytes())
    assert PIL.Image.open(jpeg).size == (37, 23)
    assert load_image(jpeg.getvalue()).size == (23, 37)


def test_unreadable_refs_are_named(tmp_path, gcs_bucket):
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    png = io.BytesIO()
    _images()[0].save(png, "PNG")
    truncated = png.getvalue()[: len(png.getvalue()) // 2]
    for ref, root, words in (
        (str(tmp_path / "missing.png"), None, "missing.png does not exist"),
        ("sub/missing.png", str(tmp_path), "0/sub/missing.png does not exist"),  # (under root)
        (f"{gcs_bucket}/nowhere.png", None, "gs://posttrain-test/nowhere.png does not exist"),
        (str(tmp_path), None, "cannot be read"),  # a directory
        (str(tmp_path / "broken.png"), None, "broken.png cannot be decoded"),
        ({"bytes": None, "path": "broken.png"}, str(tmp_path), "broken.png cannot be decoded"),
        ("https://example.com/cat.png", None, "cat.png is a web URL.*not fetched at training"),
        ({"url": "http://example.com/cat.png"}, None, "not fetched at training time"),
        (b"\x00\x01garbage", None, "cannot be decoded \\(not a format Pillow reads"),
        (truncated, None, "cannot be decoded \\(image file is truncated"),
        (42, None, "image 42 is a int"),
        ({"caption": "a cat"}, None, "has no 'bytes', 'path' or 'url'"),
        ("data:image/png,abc", None, "base64"),
        ("data:image/png;base64,@@@", None, "bad base64"),
    ):
        with pytest.raises(ImageError, match=words):
            load_image(ref, root=root)
    long = "/no/such/" + "x" * 10_000 + ".png"
    with pytest.raises(ImageError) as e:
        load_image(long)
    assert len(str(e.value)) < 200
    with pytest.raises(ImageError) as e:
        load_image(b"\x00" * 100_000)
    assert len(str(e.value)) < 300
