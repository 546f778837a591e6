"""The demo assets: the 512-token tokenizer against transformers, deterministic disjoint data."""

import hashlib
import json
from pathlib import Path

import pytest

from posttrain.data import load_tokenizer
from posttrain.demo import ASSETS_DIR, build_assets, build_tokenizer, problem_key

transformers = pytest.importorskip("transformers")

FILES = ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "train.jsonl", "eval.jsonl")


def _digests(root) -> dict[str, str]:
    return {f: hashlib.sha256((Path(root) / f).read_bytes()).hexdigest() for f in FILES}


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("assets"), n_train=2000, n_eval=300, seed=5)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ASSETS_DIR / "tokenizer")


def test_build_is_deterministic(assets, tmp_path):
    again = build_assets(tmp_path, n_train=2000, n_eval=300, seed=5)
    assert again == {name: str(tmp_path / Path(p).name) for name, p in assets.items()}
    assert _digests(tmp_path) == _digests(Path(assets["train"]).parent)


def test_shipped_assets_are_current(tmp_path):
    # Regenerated in this process, compared with the files another process wrote: equal bytes
    # mean the build does not depend on hash seeds, and that the shipped copy is up to date.
    build_assets(tmp_path)
    assert _digests(tmp_path) == _digests(ASSETS_DIR), "run `python -m posttrain.demo._assets`"
    total = sum((ASSETS_DIR / f).stat().st_size for f in FILES)
    assert total < 3_000_000


def test_datasets_disjoint(assets):
    train, held_out = _read_jsonl(assets["train"]), _read_jsonl(assets["eval"])
    assert (len(train), len(held_out)) == (2000, 300)
    train_keys, eval_keys = {problem_key(r) for r in train}, {problem_key(r) for r in held_out}
    assert len(train_keys) == 2000 and len(eval_keys) == 300
    assert not train_keys & eval_keys
    shipped = {problem_key(r) for r in _read_jsonl(ASSETS_DIR / "train.jsonl")}
    assert not shipped & {problem_key(r) for r in _read_jsonl(ASSETS_DIR / "eval.jsonl")}


def test_held_out_set_does_not_depend_on_train_size(assets, tmp_path):
    other = build_assets(tmp_path, n_train=100, n_eval=300, seed=5)
    assert Path(other["eval"]).read_bytes() == Path(assets["eval"]).read_bytes()


def test_vocab_and_special_tokens(tokenizer):
    hf = transformers.AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    assert tokenizer.vocab_size == len(hf) == 512
    ids = {
        t: tokenizer.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    assert list(ids.values()) == [0, 1, 2]
    assert (tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id) == (2, 0, None)
    assert (hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (2, 0, None)


def test_digits_are_single_tokens(tokenizer):
    digit_ids = [tokenizer.encode(str(d)) for d in range(10)]
    assert all(len(ids) == 1 for ids in digit_ids) and len({i[0] for i in digit_ids}) == 10
    for text in ("936", "-936", " 936", "1998"):
        pieces = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
        assert [p for p in pieces if p.strip("- ")] == list(text.strip("- ")), text
    assert tokenizer.decode(tokenizer.encode("What is 347 - 589?")) == "What is 347 - 589?"


def test_assistant_mask_covers_answer_and_end(tokenizer):
    for record in _read_jsonl(ASSETS_DIR / "eval.jsonl")[:50]:
        ids, mask = tokenizer.encode_chat(record["messages"])
        masked = [i for i, m in zip(ids, mask, strict=True) if m]
        assert (
            tokenizer.decode(masked, skip_special_tokens=False) == record["answer"] + "<|im_end|>"
        )
        # One contiguous run, right after the generation prompt and before the final newline.
        prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True)
        assert ids[: len(prompt)] == prompt
        assert mask == [False] * len(prompt) + [True] * len(masked) + [False]
        assert len(masked) == len(record["answer"]) + 1  # one token per digit or sign, then EOS


def test_chat_template_matches_transformers(tokenizer):
    hf = transformers.AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")
    records = _read_jsonl(ASSETS_DIR / "eval.jsonl")[:20]
    for record in records:
        for messages, gen in ((record["messages"], False), (record["prompt"], True)):
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            )
            assert text == hf.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            )
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            assert ids == hf.apply_chat_template(messages, add_generation_prompt=gen)["input_ids"]
            assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    user, answer = records[0]["prompt"][0]["content"], records[0]["answer"]
    assert tokenizer.apply_chat_template(records[0]["messages"], tokenize=False) == (
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
    )


def test_build_tokenizer_alone(tmp_path):
    path = build_tokenizer(tmp_path / "tok")
    assert sorted(p.name for p in Path(path).iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert load_tokenizer(path).vocab_size == 512
