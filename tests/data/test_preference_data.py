"""Preference pairs: masks on exactly the response tokens, shared prompts, bad pairs, batches."""

import json

import numpy as np
import pytest

from posttrain.data import (
    DataConfig,
    PairError,
    SourceConfig,
    encode_pair,
    load_tokenizer,
    make_preference_pipeline,
    preference_batches,
)
from posttrain.demo import ASSETS_DIR

PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
CHAT_PROMPT_TEXT = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    """The demo's ChatML tokenizer (EOS <|im_end|>, no BOS)."""
    return load_tokenizer(str(ASSETS_DIR) + "/tokenizer")


def _text(tok, ids):
    return tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _trained(tok, side):
    """The text of the targets the loss is computed on."""
    return _text(tok, side["targets"][side["loss_mask"] > 0])


def test_chat_pair_masks_exactly_the_responses(tok):
    record = {
        "prompt": PROMPT,
        "chosen": "5",
        "rejected": [{"role": "assistant", "content": "6"}],
    }
    pair = encode_pair(tok, record, max_len=64)
    chosen, rejected = pair["chosen"], pair["rejected"]
    assert _text(tok, chosen["tokens"]) == CHAT_PROMPT_TEXT + "5<|im_end|>\n"
    assert _text(tok, rejected["tokens"]) == CHAT_PROMPT_TEXT + "6<|im_end|>\n"
    assert _trained(tok, chosen) == "5<|im_end|>"
    assert _trained(tok, rejected) == "6<|im_end|>"
    # The mask is contiguous and starts right after the shared prompt.
    n_prompt = len(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    np.testing.assert_array_equal(chosen["tokens"][:n_prompt], rejected["tokens"][:n_prompt])
    on = np.flatnonzero(chosen["loss_mask"])
    assert on[0] == n_prompt - 1 and np.all(np.diff(on) == 1)
    assert pair["domain"] is None and not pair["truncated"]


def test_text_pair_is_prompt_then_response_then_eos(tok):
    pair = encode_pair(tok, {"prompt": "Q: 2 + 3 =", "chosen": " 5", "rejected": " 6"}, max_len=64)
    assert _text(tok, pair["chosen"]["tokens"]) == "Q: 2 + 3 = 5<|im_end|>"
    assert _trained(tok, pair["chosen"]) == " 5<|im_end|>"
    assert _trained(tok, pair["rejected"]) == " 6<|im_end|>"


def test_batch_arrays_are_padded_rows(tok):
    records = [
        {"prompt": PROMPT, "chosen": "5", "rejected": "6", "domain": "math"},
        {"prompt": "Hi", "chosen": " hello there", "rejected": " no", "domain": "chat"},
        {"prompt": PROMPT, "chosen": "5", "rejected": "-5"},
    ]
    data = preference_batches(records, tok, max_len=40, batch_size=4, shuffle=False, num_epochs=1)
    batch = next(data)
    with pytest.raises(StopIteration):
        next(data)
    for side in ("chosen", "rejected"):
        for name in ("tokens", "targets", "loss_mask", "positions", "segment_ids"):
            assert batch[f"{side}_{name}"].shape == (4, 40)
        seg = batch[f"{side}_segment_ids"]
        n = seg.sum(axis=1)
        assert n[3] == 0 and batch[f"{side}_loss_mask"][3].sum() == 0  # the filler row
        for r in range(3):
            np.testing.assert_array_equal(seg[r, : n[r]], 1)
            np.testing.assert_array_equal(seg[r, n[r] :], 0)
            np.testing.assert_array_equal(batch[f"{side}_positions"][r, : n[r]], np.arange(n[r]))
            assert batch[f"{side}_loss_mask"][r, n[r] :].sum() == 0
    assert _text(tok, batch["rejected_targets"][2][batch["rejected_loss_mask"][2] > 0]) == (
        "-5<|im_end|>"
    )
    assert data.domains == ("", "chat", "math")
    assert data.stats["domains"] == {"": 1, "chat": 1, "math": 1}
    np.testing.assert_array_equal(batch["domain_ids"], [2, 1, 0, -1])
    assert data.stats["read"] == data.stats["used"] == 3


BAD = [
    ({"prompt": PROMPT, "chosen": "5", "rejected": "5"}, "identical"),
    ({"prompt": PROMPT, "chosen": "", "rejected": "6"}, "empty"),
    (
        {"prompt": PROMPT, "chosen": "5", "rejected": [{"role": "assistant", "content": " "}]},
        "empty",
    ),  # fmt: skip
    ({"prompt": PROMPT, "chosen": "5"}, "malformed"),
    ({"prompt": PROMPT, "chosen": 5, "rejected": "6"}, "malformed"),
    (
        {"prompt": "text", "chosen": [{"role": "assistant", "content": "5"}], "rejected": "6"},
        "malformed",
    ),  # fmt: skip
    ("not json", "malformed"),
]


@pytest.mark.parametrize("record, reason", BAD)
def test_bad_pair_raises_with_reason(tok, record, reason):
    with pytest.raises(PairError) as e:
        encode_pair(tok, record, max_len=64)
    assert e.value.reason == reason


def test_bad_pairs_are_counted_or_raised(tok):
    good = {"prompt": PROMPT, "chosen": "5", "rejected": "6"}
    long = {"prompt": PROMPT, "chosen": "5 " * 40, "rejected": "6"}
    records = [good, *(r for r, _ in BAD), long, json.dumps(good)]
    data = preference_batches(records, tok, max_len=32, batch_size=2, overlong="drop")
    stats = data.stats
    assert stats["read"] == len(records) and stats["used"] == 2
    counts = [stats[k] for k in ("identical", "empty", "malformed", "dropped")]
    assert counts == [1, 2, 4, 1]
    assert len(stats["errors"]) == 7 and stats["errors"][0].startswith("record 1:")
    with pytest.raises(PairError, match=r"preference record 1: .*same tokens.*on_error='skip'"):
        preference_batches(records, tok, max_len=32, batch_size=2, on_error="raise")


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_each_source_counts_and_reports_what_it_cut_or_left_out(tok, tmp_path, caplog, overlong):
    good = {"prompt": PROMPT, "chosen": "5", "rejected": "6"}
    long = {"prompt": PROMPT, "chosen": "5 " * 40, "rejected": "6"}
    files = {"math": [good, long, "not json", long], "chat": [good, long, {**good, "chosen": ""}]}
    sources = []
    for name, records in files.items():
        (tmp_path / f"{name}.jsonl").write_text(
            "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        )
        sources.append(SourceConfig(str(tmp_path / f"{name}.jsonl")))
    config = DataConfig(
        sources=tuple(sources), max_len=32, batch_size=2, packing=False, on_error="skip",
        overlong=overlong,
    )  # fmt: skip
    with caplog.at_level("INFO", logger="posttrain.data"):
        data = make_preference_pipeline(config, tok, process_index=0, process_count=1)
        data.log_stats()

    cut = "truncated" if overlong == "truncate" else "dropped"
    kept = int(overlong == "truncate")
    zero = dict.fromkeys(("skipped", "truncated", "dropped", "no_loss"), 0)
    assert data.stats["sources"] == {
        "math": {**zero, "read": 4, "used": 1 + 2 * kept, "skipped": 1, cut: 2},
        "chat": {**zero, "read": 3, "used": 1 + kept, "skipped": 1, cut: 1},
    }
    assert data.stats["skipped"] == 2 and data.stats[cut] == 3
    assert data.batch_metrics() == {
        "data/truncated": 3.0 * kept,
        "data/dropped": 3.0 * (1 - kept),
        "data/skipped": 2.0,
        "data/no_loss": 0.0,
        f"data/math/{cut}": 2.0,
        "data/math/skipped": 1.0,
        f"data/chat/{cut}": 1.0,
        "data/chat/skipped": 1.0,
    }
    how = (
        "truncated to max_len=32" if kept else "dropped as longer than max_len=32 (overlong='drop')"
    )
    bad = "skipped as malformed or with an empty or identical response (on_error='skip')"
    lines = [r.getMessage() for r in caplog.records if "data source" in r.message]
    math, chat = sources[0].path, sources[1].path
    assert lines == [
        f"data source {math}, when encoding its pairs: 2 of 4 records {how}, 1 {bad}",
        f"data source {chat}, when encoding its pairs: 1 of 3 records {how}, 1 {bad}",
        f"data source {math}, at the end of the run: 2 of 4 records {how}, 1 {bad}",
        f"data source {chat}, at the end of the run: 1 of 3 records {how}, 1 {bad}",
    ]


def test_truncation_keeps_or_counts(tok):
    # The prompt alone fills max_len: no response token survives truncation.
    record = {"prompt": "word " * 30, "chosen": " a", "rejected": " b"}
    with pytest.raises(PairError) as e:
        encode_pair(tok, record, max_len=8)
    assert e.value.reason == "no_loss"
    long = {"prompt": PROMPT, "chosen": "5 " * 40, "rejected": "6"}
    pair = encode_pair(tok, long, max_len=24)
    assert pair["truncated"] and len(pair["chosen"]["tokens"]) == 24
    assert encode_pair(tok, long, max_len=24, overlong="drop") is None


def test_batches_are_deterministic_and_reshuffled(tok, tmp_path):
    records = [{"prompt": PROMPT, "chosen": str(i), "rejected": str(i + 1)} for i in range(8)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

    answer = len(tok.apply_chat_template(PROMPT, add_generation_prompt=True))

    def firsts(data, n):  # the chosen answer token of each row
        return [tuple(next(data)["chosen_tokens"][:, answer].tolist()) for _ in range(n)]

    a = firsts(preference_batches(records, tok, max_len=32, batch_size=4, seed=3), 4)
    b = firsts(preference_batches(path, tok, max_len=32, batch_size=4, seed=3), 4)
    c = firsts(preference_batches(records, tok, max_len=32, batch_size=4, seed=4), 4)
    assert a == b and a != c
    epoch0, epoch1 = sorted(a[0] + a[1]), sorted(a[2] + a[3])
    assert epoch0 == epoch1 and a[:2] != a[2:]  # every pair once per epoch, in a new order
