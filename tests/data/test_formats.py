"""Record formats: which tokens each format trains on, and how malformed records are reported."""

import numpy as np
import pytest

from posttrain.data._formats import (
    ExampleEncoder,
    RecordError,
    decode,
    detect_format,
    encode_record,
    to_example,
)


def _trained_text(tok, ids, trained):
    return tok.decode(
        [i for i, t in zip(ids, trained, strict=True) if t], skip_special_tokens=False
    )


def test_messages_train_on_assistant_turns_only(chatml):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And two plus two?"},
        {"role": "assistant", "content": "Four."},
    ]
    ids, trained = encode_record({"messages": messages}, "auto", chatml, add_eos=True)
    assert ids == chatml.apply_chat_template(messages)
    assert _trained_text(chatml, ids, trained) == "Paris.<|im_end|>Four.<|im_end|>"
    untrained = [i for i, t in zip(ids, trained, strict=True) if not t]
    assert "What is the capital of France?" in chatml.decode(untrained, skip_special_tokens=False)


def test_prompt_completion_trains_on_completion_and_eos(llama3):
    record = {"prompt": "Two plus two equals", "completion": " four."}
    ids, trained = encode_record(record, "auto", llama3, add_eos=True)
    assert ids[0] == llama3.bos_id  # the post-processor's BOS, as encode(text) gives
    assert ids[-1] == llama3.eos_id
    assert _trained_text(llama3, ids, trained) == " four.<|eot_id|>"
    prompt = [i for i, t in zip(ids, trained, strict=True) if not t]
    assert (
        llama3.decode(prompt, skip_special_tokens=False) == "<|begin_of_text|>Two plus two equals"
    )
    ids, trained = encode_record(record, "prompt_completion", llama3, add_eos=False)
    assert _trained_text(llama3, ids, trained) == " four."


def test_chat_prompt_with_string_completion(chatml):
    prompt = [{"role": "user", "content": "Say hi."}]
    ids, trained = encode_record(
        {"prompt": prompt, "completion": "Hello!"}, "auto", chatml, add_eos=True
    )
    head = chatml.apply_chat_template(prompt, add_generation_prompt=True)
    assert ids[: len(head)] == head and not any(trained[: len(head)])
    assert _trained_text(chatml, ids, trained) == "Hello!<|im_end|>"  # the template ends the turn


def test_chat_prompt_assistant_turns_are_context(chatml):
    prompt = [
        {"role": "user", "content": "Example?"},
        {"role": "assistant", "content": "Example answer."},
        {"role": "user", "content": "Now you."},
    ]
    completion = [{"role": "assistant", "content": "My answer."}]
    record = {"prompt": prompt, "completion": completion}
    ids, trained = encode_record(record, "prompt_completion", chatml, add_eos=True)
    assert _trained_text(chatml, ids, trained) == "My answer.<|im_end|>"


def test_text_trains_on_every_token_after_the_first(chatml):
    ids, trained = encode_record({"text": "The sea is wide."}, "auto", chatml, add_eos=True)
    assert chatml.decode(ids, skip_special_tokens=False) == "The sea is wide.<|im_end|>"
    assert trained == [False] + [True] * (len(ids) - 1)


def test_to_example_shifts_targets_within_the_document():
    ex = to_example([5, 6, 7, 8], [False, False, True, True])
    np.testing.assert_array_equal(ex["tokens"], [5, 6, 7, 8])
    np.testing.assert_array_equal(ex["targets"], [6, 7, 8, 0])
    np.testing.assert_array_equal(ex["loss_mask"], [0, 1, 1, 0])
    assert ex["tokens"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32


@pytest.mark.parametrize(
    "record, fmt, match",
    [
        ({"foo": 1}, "auto", "match no format"),
        ({"messages": "hi"}, "auto", "'messages' must be a list"),
        ({"messages": [{"role": "user"}]}, "auto", "cannot render"),
        ({"prompt": 1, "completion": "x"}, "auto", "'prompt' must be a string or a list"),
        ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "auto", "string"),
        ({"text": ["a"]}, "auto", "'text' must be a string"),
        ({"text": "a"}, "messages", "missing key 'messages'"),
    ],
)
def test_malformed_records_say_what_was_expected(chatml, record, fmt, match):
    with pytest.raises(RecordError, match=match) as e:
        encode_record(record, fmt, chatml, add_eos=True)
    assert "expected" in str(e.value)


def test_decode_rejects_invalid_json_and_non_objects():
    assert decode(b'{"text": "a"}') == {"text": "a"}
    with pytest.raises(RecordError, match="invalid JSON"):
        decode(b'{"text": ')
    with pytest.raises(RecordError, match="expected a JSON object, got a list"):
        decode(b"[1, 2]")
    assert detect_format({"prompt": "a", "completion": "b", "text": "c"}) == "prompt_completion"


def test_encoder_names_location_or_marks_the_record(chatml):
    encode = ExampleEncoder(chatml, "auto", max_len=4, source=1, domain=2)
    with pytest.raises(RecordError, match=r"f.jsonl line 3: invalid JSON.*on_error='skip'"):
        encode((b"{oops", "f.jsonl line 3"))
    skip = ExampleEncoder(chatml, "auto", max_len=4, source=1, on_error="skip")
    assert skip((b"{oops", "f.jsonl line 3"))["status"] == "skipped"
    long = {"text": "The quick brown fox jumps over the lazy dog."}
    out = encode((long, "f.parquet row 0"))
    assert out["truncated"] and len(out["example"]["tokens"]) == 4
    np.testing.assert_array_equal(out["example"]["domain_ids"], [2, 2, 2, 2])
    drop = ExampleEncoder(chatml, "auto", max_len=4, overlong="drop")
    assert drop((long, "x"))["status"] == "dropped"
    no_assistant = {"messages": [{"role": "user", "content": "hi"}]}
    assert ExampleEncoder(chatml, "auto", 64)((no_assistant, "x"))["status"] == "no_loss"
