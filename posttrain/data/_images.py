"""Images for vision-language models: read from wherever a record names them, then resized and
normalised the way the model's own Hugging Face image processor does it.

`load_image(ref)` reads a path (relative to a root, `~`, or gs://), raw bytes, a
`data:image/...;base64,` URL or the `{"bytes", "path"}` dict Hugging Face datasets store images
as in Parquet, with Pillow; EXIF orientation is applied (`ImageOps.exif_transpose`), as
photos are meant to be seen. `preprocess_images(images, vision)` converts each to RGB, resizes
it straight to the model's square `image_size` with its resampling filter (Gemma 3's and
SigLIP's processors do not keep the aspect ratio), rescales by 1/255 and normalises with the
model's mean and std: what transformers' `SiglipImageProcessor` / `Gemma3ImageProcessor` give,
channels last. `image_array(ref, vision)` does both for one image.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps

from posttrain import paths
from posttrain.models import VisionConfig

_RESAMPLE = {"bilinear": PIL.Image.Resampling.BILINEAR, "bicubic": PIL.Image.Resampling.BICUBIC}


class ImageError(ValueError):
    """An image that cannot be read; the message says which and why."""


def _short(ref: Any) -> str:
    """A ref for a message, at most 80 characters: a long one keeps its start and its end (a
    path's file name)."""
    text = repr(ref) if not isinstance(ref, str) else ref
    return text if len(text) <= 80 else text[:30] + "..." + text[-47:]


def _read_bytes(ref: str, root: str | None) -> bytes:
    """The bytes of a local or gs:// file (a relative path under `root`)."""
    if ref.startswith(("http://", "https://")):
        raise ImageError(
            f"image {_short(ref)} is a web URL; images are not fetched at training time: "
            "download them and name the files (or a gs:// path), or store their bytes"
        )
    if not paths.is_remote(ref):
        ref = os.path.expanduser(ref)
        if not os.path.isabs(ref) and root:
            ref = paths.join(root, ref)
    try:
        with paths.path(ref).open("rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError(
            f"image file {_short(ref)} does not exist; relative paths resolve against the data "
            "file's directory"
        ) from None
    except OSError as e:  # a directory, no permission, a failed download
        reason = e.strerror or _short(str(e))  # (str(e) repeats the whole path)
        raise ImageError(f"image file {_short(ref)} cannot be read ({reason})") from None


def _decode(data: bytes, what: str) -> PIL.Image.Image:
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()
    except PIL.UnidentifiedImageError:
        reason = "not a format Pillow reads"
    except (OSError, ValueError) as e:  # truncated, corrupt
        reason = _short(str(e))
    else:
        return PIL.ImageOps.exif_transpose(image)
    raise ImageError(f"image {what} cannot be decoded ({reason}); is it a PNG/JPEG/... file?")


def load_image(ref: Any, *, root: str | None = None) -> PIL.Image.Image:
    """Reads one image.

    Args:
      ref: a `PIL.Image.Image` (returned as is); raw bytes; a path (absolute, `~`, relative to
        `root`, or gs://); a `data:image/...;base64,...` URL; a `{"bytes": ..., "path": ...}`
        dict (bytes win when present), or `{"url": ...}` / `{"path": ...}`.
      root: the directory relative paths resolve against (local or gs://).

    Returns:
      The decoded image, EXIF orientation applied.

    Raises:
      ImageError: the file is missing, the bytes are not an image, the ref is a web URL (not
        fetched at training time) or of an unsupported type.
    """
    if isinstance(ref, PIL.Image.Image):
        return ref
    if isinstance(ref, bytes | bytearray | memoryview):
        return _decode(bytes(ref), f"bytes {_short(bytes(ref[:40]))}")
    if isinstance(ref, Mapping):
        if ref.get("bytes") is not None:
            return load_image(ref["bytes"], root=root)
        for key in ("path", "url", "image"):
            if ref.get(key) is not None:
                return load_image(ref[key], root=root)
        raise ImageError(f"image {_short(ref)} has no 'bytes', 'path' or 'url'")
    if isinstance(ref, str):
        if ref.startswith("data:"):
            header, _, payload = ref.partition(",")
            if not header.endswith(";base64"):
                raise ImageError(f"image {_short(ref)}: data URLs must be base64-encoded")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ImageError(f"image {_short(ref)}: bad base64 ({e})") from None
            return _decode(data, _short(ref))
        return _decode(_read_bytes(ref, root), _short(ref))
    raise ImageError(
        f"image {_short(ref)} is a {type(ref).__name__}; give a path, gs:// path, data URL, "
        "bytes or a {'bytes', 'path'} dict"
    )


def _rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: transparency (an alpha band or a palette's
    transparent colour) composited onto white, anything else `convert("RGB")`."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess_images(images: Sequence[PIL.Image.Image], vision: VisionConfig) -> np.ndarray:
    """The pixels the model's HF image processor makes of `images`, channels last.

    Each image is converted to RGB (transparency onto white; grey `L` for a 1-channel encoder),
    resized straight to `vision.image_size` square with `vision.resample`, rescaled by 1/255
    and normalised by `vision.image_mean` / `vision.image_std`.

    Args:
      images: decoded images (`load_image`), any size and mode.
      vision: the model's encoder config.

    Returns:
      float32 `[len(images), S, S, C]`, S = `vision.image_size`, C = `vision.channels`.
    """
    S, C = vision.image_size, vision.channels
    out = np.zeros((len(images), S, S, C), np.float32)
    mean = np.asarray(vision.image_mean, np.float32)
    std = np.asarray(vision.image_std, np.float32)
    resample = _RESAMPLE[vision.resample]
    for i, image in enumerate(images):
        converted = _rgb(image) if C == 3 else image.convert("L")
        resized = np.asarray(converted.resize((S, S), resample=resample), np.float32)
        resized = resized.reshape(S, S, C) * np.float32(1 / 255)
        out[i] = (resized - mean) / std
    return out


def image_array(ref: Any, vision: VisionConfig, *, root: str | None = None) -> np.ndarray:
    """`preprocess_images` of the one image `load_image(ref, root=root)` reads: `[S, S, C]`."""
    return preprocess_images([load_image(ref, root=root)], vision)[0]
