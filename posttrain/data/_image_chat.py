"""Images in SFT, preference and prompt records: where they sit in the text, which files they are.

A vision-language model's record names its images in either of the two layouts datasets use:

- content parts, as in the OpenAI and Hugging Face chat formats: a message's `content` is a list
  of `{"type": "text", "text": ...}` and `{"type": "image", "image": <ref>}` parts (also
  `"path"`/`"url"` for `"image"`, or `{"type": "image_url", "image_url": {"url": <ref>}}`);
- markers, as in LLaVA/TRL datasets: the text holds the model's image token (e.g. "<image>")
  once per image, and the record's `"images"` list holds the refs in order. A `{"type": "image"}`
  part without a ref also takes the next of `"images"`.

A ref is a path (relative ones resolve against the data file's directory), a gs:// path, a
`data:image/...;base64,` URL, or the `{"bytes", "path"}` dict Hugging Face datasets store
(`posttrain.data.load_image`). Each image becomes `tokens_per_image` copies of the image token in
the text (between Gemma 3's `<start_of_image>` and `<end_of_image>` where the tokenizer has them),
so the chat template renders it and the model's projected image features replace those tokens in
order. An example cut to `max_len` is cut before an image it cannot hold whole, so packing and
truncation never split an image's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain.data._images import ImageError, load_image, preprocess_images
from posttrain.data._tokenizer import Tokenizer
from posttrain.models import VisionConfig

# Gemma 3 wraps each image's tokens in these, where the tokenizer has them.
_BEGIN, _END = "<start_of_image>", "<end_of_image>"


class ImageRecordError(ValueError):
    """A record whose images do not match its text, or cannot be read."""


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """How one VLM's images enter the token stream; build it with `image_spec`.

    Attributes:
      vision: the model's vision config (image size, normalisation, tokens per image).
      marker: the image token's text; one per image in a record's text stands for that image.
      expansion: the text one image becomes (markers, between Gemma 3's begin/end tokens).
      image_token_id, begin_id: the image token's id, and the begin token's (None without one).
      max_images: image slots per packed row (images beyond them are cut like overlong text).
    """

    vision: VisionConfig
    marker: str
    expansion: str
    image_token_id: int
    begin_id: int | None
    max_images: int

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image


def image_spec(vision: VisionConfig, tokenizer: Tokenizer, max_images: int) -> ImageSpec:
    """The `ImageSpec` of a model's vision config with its tokenizer.

    Raises:
      ValueError: the tokenizer does not have the model's image token as one special token.
    """
    marker = tokenizer.backend.id_to_token(vision.image_token_id)
    if (
        marker is None
        or tokenizer.encode(marker * 2, add_special_tokens=False) != [vision.image_token_id] * 2
    ):
        raise ValueError(
            f"the model's image token id {vision.image_token_id} is not a special token of "
            f"{tokenizer.name_or_path} (it is {marker!r}); use the tokenizer saved with the "
            "model, or add the image token to tokenizer.json's added_tokens"
        )
    if max_images < 1:
        raise ValueError(f"max_images must be at least 1, got {max_images}")
    begin_id, end_id = (tokenizer.backend.token_to_id(t) for t in (_BEGIN, _END))
    wrap = begin_id is not None and end_id is not None
    body = marker * vision.tokens_per_image
    return ImageSpec(
        vision=vision,
        marker=marker,
        expansion=f"{_BEGIN}{body}{_END}" if wrap else body,
        image_token_id=vision.image_token_id,
        begin_id=begin_id if wrap else None,
        max_images=max_images,
    )


def _part_ref(part: Mapping[str, Any]) -> Any:
    """An image part's ref, or None for a bare `{"type": "image"}` (the next of "images")."""
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None


class _Flattener:
    """Rewrites a record's text with one marker per image and collects the refs in order."""

    def __init__(self, spec: ImageSpec, images: Sequence[Any]):
        self.spec, self.refs = spec, []
        self._pool, self._next = list(images), 0

    def _take(self) -> Any:
        if self._next >= len(self._pool):
            raise ImageRecordError(
                f"the text has more images ({self._next + 1}+) than the record's 'images' list "
                f"({len(self._pool)})"
            )
        self._next += 1
        return self._pool[self._next - 1]

    def text(self, text: str) -> str:
        self.refs.extend(self._take() for _ in range(text.count(self.spec.marker)))
        return text.replace(self.spec.marker, self.spec.expansion)

    def content(self, content: Any) -> Any:
        if isinstance(content, str):
            return self.text(content)
        if not isinstance(content, list):
            return content
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                pieces.append(self.text(str(part.get("text", ""))))
            elif kind in ("image", "image_url"):
                ref = _part_ref(part)
                self.refs.append(self._take() if ref is None else ref)
                pieces.append(self.spec.expansion)
            else:
                raise ImageRecordError(
                    "content parts must be {'type': 'text', 'text': ...} or {'type': 'image', "
                    f"'image': <path, gs:// path, data URL or bytes>}}, got {part!r:.80}"
                )
        return "".join(pieces)

    def messages(self, messages: Any) -> Any:
        if not isinstance(messages, list):
            return messages
        return [
            {**m, "content": self.content(m.get("content"))} if isinstance(m, Mapping) else m
            for m in messages
        ]

    def check_used(self) -> None:
        if self._next != len(self._pool):
            raise ImageRecordError(
                f"the record's 'images' list has {len(self._pool)} images but its text places "
                f"{self._next} (one {self.spec.marker!r} or image part per image)"
            )


def flatten_record(
    record: Mapping[str, Any], spec: ImageSpec, keys: Sequence[str]
) -> tuple[dict[str, Any], list[Any]]:
    """The record with image parts and markers in `keys` expanded to image tokens (content lists
    become strings), and the image refs in order of appearance.

    Raises:
      ImageRecordError: the images the text places and the "images" list disagree, or a content
        part is neither text nor image.
    """
    images = record.get("images") or []
    if not isinstance(images, list):
        raise ImageRecordError(
            f"'images' must be a list of image refs, got {type(images).__name__}"
        )
    flat = _Flattener(spec, images)
    out = dict(record)
    for key in keys:
        if key in out:
            value = out[key]
            out[key] = flat.text(value) if isinstance(value, str) else flat.messages(value)
    flat.check_used()
    return out, flat.refs


def has_images(record: Mapping[str, Any], keys: Sequence[str]) -> bool:
    """Whether a record places images (parts or an "images" list) without a VLM to read them."""
    if record.get("images"):
        return True
    for key in keys:
        value = record.get(key)
        for m in value if isinstance(value, list) else ():
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, list) and any(
                isinstance(p, Mapping) and p.get("type") in ("image", "image_url") for p in content
            ):
                return True
    return False


def whole_images_cut(ids: Sequence[int], limit: int, spec: ImageSpec) -> tuple[int, int]:
    """(cut, images): where to cut `ids` to at most `limit` tokens and `spec.max_images` images
    without splitting one, and how many images the cut keeps. An image that would be split is
    left out with everything after it (its begin token too)."""
    n = spec.tokens_per_image
    where = np.flatnonzero(np.asarray(ids[:limit]) == spec.image_token_id)
    keep = min(len(where) // n, spec.max_images)
    cut = limit
    if keep * n < len(where):  # the next image's tokens start at where[keep * n]
        cut = int(where[keep * n])
        if spec.begin_id is not None and cut > 0 and ids[cut - 1] == spec.begin_id:
            cut -= 1
    return cut, keep


def load_pixels(
    refs: Sequence[Any], spec: ImageSpec, root: str | None, *, cache: bool = False
) -> np.ndarray:
    """Float32 pixels `[len(refs), S, S, C]`, as the model takes them. `cache`: keep the last
    64 lists of path refs read (an RL prompt's images are read at sampling and again for its
    rollout rows, every time the prompt is drawn); the arrays are then read-only.

    Raises:
      ImageRecordError: an image cannot be read (the message says which and why).
    """
    if cache and all(isinstance(r, str) for r in refs):
        return _cached_pixels(tuple(refs), spec, root)
    return _read_pixels(refs, spec, root)


@functools.lru_cache(maxsize=64)
def _cached_pixels(refs: tuple[str, ...], spec: ImageSpec, root: str | None) -> np.ndarray:
    pixels = _read_pixels(refs, spec, root)
    pixels.flags.writeable = False
    return pixels


def _read_pixels(refs: Sequence[Any], spec: ImageSpec, root: str | None) -> np.ndarray:
    try:
        images = [load_image(ref, root=root) for ref in refs]
    except ImageError as e:
        raise ImageRecordError(str(e)) from None
    return preprocess_images(images, spec.vision)


def no_pixels(spec: ImageSpec) -> np.ndarray:
    v = spec.vision
    return np.zeros((0, v.image_size, v.image_size, v.channels), np.float32)


def prompt_pixels(prompt: Mapping[str, Any], spec: ImageSpec) -> np.ndarray:
    """The pixels of an RL prompt's images (`PromptData` keeps their refs, not their pixels)."""
    refs = prompt.get("images") or ()
    if not refs:
        return no_pixels(spec)
    return load_pixels(refs, spec, prompt.get("image_root"), cache=True)


def pixel_rows(pixels: Sequence[np.ndarray], spec: ImageSpec, rows: int = 0) -> np.ndarray:
    """Per-row pixels `[k_i, S, S, C]` as one `[rows, max_images, S, S, C]` array, zeros in the
    slots a row does not use (and in rows past `len(pixels)`, up to `rows`).

    Raises:
      ValueError: a row has more images than `spec.max_images`.
    """
    v = spec.vision
    rows = max(rows, len(pixels))
    out = np.zeros((rows, spec.max_images, v.image_size, v.image_size, v.channels), np.float32)
    for row, p in zip(out, pixels, strict=False):
        if len(p) > spec.max_images:
            raise ValueError(f"{len(p)} images in a row of {spec.max_images} image slots")
        row[: len(p)] = p
    return out


def prompt_slots(vision: VisionConfig, max_prompt_len: int, max_images: int = 0) -> int:
    """Image slots of an RL rollout row: `max_images` (`data.max_images`), or as many as
    `max_prompt_len` holds."""
    return max_images or max(1, max_prompt_len // vision.tokens_per_image)


def prompt_image_spec(
    vision: VisionConfig | None, tokenizer: Tokenizer, max_prompt_len: int, max_images: int = 0
) -> ImageSpec | None:
    """The `ImageSpec` of a VLM's prompts (None for a text model), `prompt_slots` per row."""
    if vision is None:
        return None
    return image_spec(vision, tokenizer, prompt_slots(vision, max_prompt_len, max_images))


def vision_spec(config, tokenizer: Tokenizer, vision: VisionConfig | None) -> ImageSpec | None:
    """The `ImageSpec` of a VLM's SFT or preference data (None for a text model): a
    `DataConfig`'s `max_images` slots per row, or as many as its `max_len` holds."""
    return prompt_image_spec(vision, tokenizer, config.max_len, config.max_images)


def image_root(pattern: str) -> str:
    """The directory a source's relative image paths resolve against: its file's, or for a
    glob the directory before the first wildcard."""
    head = pattern[: min((pattern.find(c) for c in "*?[" if c in pattern), default=len(pattern))]
    return os.path.dirname(head) or "."
