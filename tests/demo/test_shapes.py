"""The shapes task: its images hold what their facts say, the same seed writes the same bytes,
and its tokenizer is the one transformers reads, with `<image>` the tiny VLM's image token."""

import filecmp
import json
import os

import numpy as np
import transformers
from scipy import ndimage

from posttrain.data import load_tokenizer
from posttrain.demo._shapes import COLOURS, IMAGE_TOKEN, draw_shapes, write_task
from posttrain.models import get_preset


def test_images_hold_the_shapes_their_facts_say():
    rng = np.random.default_rng(0)
    for _ in range(100):
        image, facts = draw_shapes(rng)
        pixels = np.asarray(image).astype(int)
        ink = (pixels != 255).any(-1)
        assert ndimage.label(ink)[1] == facts["count"]  # separate blobs, none touching
        distances = {c: np.abs(pixels[ink] - np.asarray(v)).sum(-1).mean() for c, v in
                     COLOURS.items()}  # fmt: skip
        assert min(distances, key=distances.get) == facts["colour"]


def test_the_same_seed_writes_the_same_task(tmp_path):
    a = write_task(tmp_path / "a", n_train=6, n_eval=2, seed=3)
    b = write_task(tmp_path / "b", n_train=6, n_eval=2, seed=3)
    for key in ("train", "eval", "prompts", "pairs_train", "pairs_eval"):
        assert filecmp.cmp(a[key], b[key], shallow=False)
    names = sorted(os.listdir(a["images"]))
    assert len(names) == 8
    assert all(filecmp.cmp(os.path.join(a["images"], n), os.path.join(b["images"], n),
                           shallow=False) for n in names)  # fmt: skip
    with open(a["train"]) as f:
        for line in f:
            ref = json.loads(line)["messages"][0]["content"][0]["image"]
            assert os.path.isfile(os.path.join(os.path.dirname(a["train"]), ref))


def test_tokenizer_matches_transformers_and_the_tiny_vlm(tmp_path):
    paths = write_task(tmp_path, n_train=2, n_eval=2)
    ours = load_tokenizer(paths["tokenizer"])
    theirs = transformers.AutoTokenizer.from_pretrained(paths["tokenizer"])
    messages = [
        {"role": "user", "content": f"{IMAGE_TOKEN}How many shapes are there?"},
        {"role": "assistant", "content": "3"},
    ]
    ids, mask = ours.encode_chat(messages)
    assert ids == theirs.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ours.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "3"
    vlm = get_preset("tiny_vlm")
    assert ours.backend.token_to_id(IMAGE_TOKEN) == vlm.vision.image_token_id
    assert ours.vocab_size <= vlm.vocab_size and ours.backend.token_to_id("[UNK]") is not None
