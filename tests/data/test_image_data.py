"""Image-text records for a vision-language model: both record layouts place the same image
tokens and pixels, packing and truncation never split an image's tokens, each row's images
follow its image tokens in order, and bad records are named (or skipped and counted)."""

import base64
import dataclasses
import json

import numpy as np
import PIL.Image
import pytest

from posttrain.data import DataConfig, SourceConfig, load_tokenizer, make_pipeline
from posttrain.data._formats import ExampleEncoder, RecordError
from posttrain.data._image_chat import image_spec
from posttrain.data._images import preprocess_images
from posttrain.demo._shapes import IMAGE_TOKEN, build_tokenizer
from posttrain.models import get_preset

QUESTION = "How many shapes are there?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(tokenizer, vision config, directory of solid-colour PNGs named by their colour index)."""
    root = tmp_path_factory.mktemp("vlm_data")
    tokenizer = load_tokenizer(build_tokenizer(root / "tokenizer"))
    vision = get_preset("tiny_vlm").vision
    (root / "images").mkdir()
    for i in range(12):  # colour i: red channel 20 * i, so a row's slots tell which image it holds
        PIL.Image.new("RGB", (20 + i, 17), (20 * i, 100, 200)).save(root / "images" / f"{i}.png")
    return tokenizer, vision, root


def _red_index(pixels: np.ndarray, vision) -> int:
    """Which solid-colour image a preprocessed one is (its red channel, de-normalised)."""
    red = pixels[..., 0].mean() * vision.image_std[0] + vision.image_mean[0]
    return int(round(red * 255 / 20))


def _chat(images: list[int], answer: str = "3", layout: str = "parts") -> dict:
    if layout == "parts":
        content = [{"type": "image", "image": f"images/{i}.png"} for i in images]
        user = {"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}
        record = {"messages": [user]}
    else:  # markers in the text, refs in "images"
        user = {"role": "user", "content": IMAGE_TOKEN * len(images) + QUESTION}
        record = {"messages": [user], "images": [f"images/{i}.png" for i in images]}
    record["messages"].append({"role": "assistant", "content": answer})
    return record


def _encoder(tokenizer, vision, root, max_len=512, max_images=4, **kwargs):
    return ExampleEncoder(
        tokenizer, "auto", max_len, images=image_spec(vision, tokenizer, max_images),
        image_root=str(root), **kwargs,
    )  # fmt: skip


def test_record_layouts_place_the_same_image_tokens_and_pixels(vlm):
    tokenizer, vision, root = vlm
    encode = _encoder(tokenizer, vision, root)
    parts = encode((json.dumps(_chat([3, 7])), "parts"))["example"]
    markers = encode((json.dumps(_chat([3, 7], layout="markers")), "markers"))["example"]
    data_url = _chat([3, 7])
    with open(root / "images" / "3.png", "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    data_url["messages"][0]["content"][0] = {"type": "image_url", "image_url": {"url": url}}
    inline = encode((json.dumps(data_url), "data url"))["example"]
    for other in (markers, inline):
        for key in ("tokens", "targets", "loss_mask"):
            np.testing.assert_array_equal(parts[key], other[key])
        np.testing.assert_array_equal(parts["images"], other["images"])
    expected = preprocess_images(
        [PIL.Image.open(root / "images" / f"{i}.png") for i in (3, 7)], vision
    )
    np.testing.assert_array_equal(parts["images"], expected)
    image = parts["tokens"] == vision.image_token_id
    assert image.sum() == 2 * vision.tokens_per_image
    trained = parts["targets"][parts["loss_mask"] > 0]
    assert tokenizer.decode(trained.tolist(), skip_special_tokens=False) == "3 <|im_end|>"


def _runs(tokens: np.ndarray, image_id: int) -> list[int]:
    """Lengths of the runs of image tokens in a row (they sit between other tokens)."""
    runs, n = [], 0
    for t in [*tokens.tolist(), -1]:
        if t == image_id:
            n += 1
        elif n:
            runs, n = [*runs, n], 0
    return runs


def test_packed_rows_keep_every_image_whole_and_in_order(vlm, tmp_path):
    tokenizer, vision, root = vlm
    N = vision.tokens_per_image
    counts = [0, 1, 2, 1, 3, 0, 2, 1, 1, 2, 0, 1]
    starts = np.cumsum([0, *counts[:-1]]) % 12
    records = [_chat([(s + i) % 12 for i in range(k)]) for s, k in zip(starts, counts, strict=True)]
    path = root / "packed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    config = DataConfig(
        sources=(SourceConfig(str(path)),), max_len=3 * N + 40, batch_size=4, shuffle=False,
        num_epochs=1, max_images=3,
    )  # fmt: skip
    data = make_pipeline(config, tokenizer, process_index=0, process_count=1, vision=vision)
    found, documents = [], 0
    for batch in data:
        assert batch["images"].shape[1:] == (3, vision.image_size, vision.image_size, 3)
        for tokens, segments, pixels in zip(
            batch["tokens"], batch["segment_ids"], batch["images"], strict=True
        ):
            image = tokens == vision.image_token_id
            # no image cut apart (a document's adjacent images make one run of k * N)
            assert all(r % N == 0 for r in _runs(tokens, vision.image_token_id))
            used = [i for i in range(3) if np.abs(pixels[i]).sum() > 0]
            assert used == list(range(image.sum() // N))  # slots fill in order, one per image
            slots = [_red_index(pixels[i], vision) for i in used]
            for segment in sorted(set(segments[segments > 0].tolist())):
                documents += 1
                k = int((image & (segments == segment)).sum()) // N
                found.append(tuple(slots[:k]))  # this document's images, from the row's slots
                slots = slots[k:]
    assert documents == len(records)
    expected = [tuple((s + i) % 12 for i in range(k)) for s, k in zip(starts, counts, strict=True)]
    assert sorted(found) == sorted(expected)


def _two_turns() -> dict:
    """Image 1 and a question, answered; then images 2 and 3 and a question, answered."""
    first = _chat([1], answer="2")["messages"]
    second = _chat([2, 3], answer="4")["messages"]
    return {"messages": first + second}


def test_truncation_cuts_before_an_image_it_cannot_hold(vlm):
    tokenizer, vision, root = vlm
    N = vision.tokens_per_image
    full = _encoder(tokenizer, vision, root)((json.dumps(_two_turns()), "x"))["example"]
    image = full["tokens"] == vision.image_token_id
    starts = np.flatnonzero(image)[::N]  # where each image's N tokens begin
    assert len(starts) == 3 and image.sum() == 3 * N
    for max_len, max_images, kept in ((int(starts[2]) + N // 2, 4, 2), (1024, 1, 1)):
        out = _encoder(tokenizer, vision, root, max_len=max_len, max_images=max_images)(
            (json.dumps(_two_turns()), "x")
        )
        example = out["example"]
        assert out["truncated"] and len(example["images"]) == kept
        assert len(example["tokens"]) <= int(starts[kept])  # cut before image kept + 1
        assert (example["tokens"] == vision.image_token_id).sum() == kept * N
        np.testing.assert_array_equal(example["images"], full["images"][:kept])
        assert example["loss_mask"].sum() == 2  # the first answer and its end-of-turn


def test_bad_image_records_are_named_or_counted(vlm, tmp_path):
    tokenizer, vision, root = vlm
    encode = _encoder(tokenizer, vision, root)
    extra = {**_chat([1], layout="markers"), "images": ["images/1.png", "images/2.png"]}
    missing = _chat([1])
    missing["messages"][0]["content"][0]["image"] = "images/nope.png"
    for record, words in ((extra, "has 2 images but its text places 1"), (missing, "nope.png")):
        with pytest.raises(RecordError, match=words):
            encode((json.dumps(record), "data.jsonl line 3"))
        skip = dataclasses.replace(encode, on_error="skip")((json.dumps(record), "line 3"))
        assert skip["status"] == "skipped" and words in skip["error"]
    text_model = ExampleEncoder(tokenizer, "auto", 512)
    with pytest.raises(RecordError, match="no vision tower"):
        text_model((json.dumps(_chat([1])), "line 4"))


def test_hf_parquet_images_mix_with_text_only_chats(vlm, tmp_path):
    """Hugging Face's VLM dataset layout in Parquet (an "images" column of {"bytes", "path"}
    and bare {"type": "image"} parts) mixed with a text-only JSON-lines source: each batch row's
    pixels are its images' (decoded from the bytes), text-only documents bring none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer, vision, root = vlm
    N = vision.tokens_per_image
    rows = []
    for i in range(6):
        with open(root / "images" / f"{i}.png", "rb") as f:
            data = f.read()
        user = [{"type": "image", "text": None}, {"type": "text", "text": QUESTION}]
        rows.append({
            "messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": "2",
                                                            "image": None}]}],
            "images": [{"bytes": data, "path": None}],
        })  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "vlm.parquet")
    text = [{"messages": [{"role": "user", "content": QUESTION},
                          {"role": "assistant", "content": "4"}]}] * 6  # fmt: skip
    (tmp_path / "text.jsonl").write_text("\n".join(json.dumps(r) for r in text))
    config = DataConfig(
        sources=(SourceConfig(str(tmp_path / "vlm.parquet")),
                 SourceConfig(str(tmp_path / "text.jsonl"))),
        max_len=2 * N + 40, batch_size=4, shuffle=False, num_epochs=1, max_images=2,
    )  # fmt: skip
    data = make_pipeline(config, tokenizer, process_index=0, process_count=1, vision=vision)
    seen, decoded = {"image": 0, "text": 0}, []
    for batch in data:
        for tokens, segments, pixels in zip(
            batch["tokens"], batch["segment_ids"], batch["images"], strict=True
        ):
            slots = [_red_index(p, vision) for p in pixels if np.abs(p).sum() > 0]
            for segment in sorted(set(segments[segments > 0].tolist())):
                k = int(((tokens == vision.image_token_id) & (segments == segment)).sum()) // N
                seen["image" if k else "text"] += 1
            assert len(slots) == (tokens == vision.image_token_id).sum() // N
            decoded += slots
    assert seen == {"image": 6, "text": 6} and sorted(decoded) == list(range(6))
    assert data.stats["skipped"] == 0
