"""posttrain.data.load_tokenizer against transformers.AutoTokenizer on the same directories."""

import json
import pickle
import re

import jinja2
import pytest

from posttrain.data import load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello there! How are you doing today?",
    "  leading and trailing spaces  ",
    "Naïve café — 東京 🙂🚀 and a new token-ish word: supercalifragilistic",
    "<|im_start|>user\nhi<|im_end|>\n",
    "special<|endoftext|>inside text<|eot_id|>",
    "line one\n\n\tline two\r\n",
    "",
]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And 2+2? Answer in 東京 style 🙂"},
    {"role": "assistant", "content": "Four 🙂, naïvely."},
]
CHATS = [CHAT, CHAT[1:3], CHAT[1:4], [{"role": "user", "content": "<|im_end|> sneaky"}]]


@pytest.fixture(scope="module", params=["chatml_dir", "llama3_dir", "generation_dir"])
def pair(request):
    """(ours, HF's) tokenizer for each fixture directory."""
    path = request.getfixturevalue(request.param)
    return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_decode_match_hf(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    assert ours.encode_batch(TEXTS) == [hf.encode(t) for t in TEXTS]
    assert ours.decode_batch([ours.encode(t) for t in TEXTS]) == hf.batch_decode(
        [hf.encode(t) for t in TEXTS], skip_special_tokens=True
    )
    assert ours.vocab_size == len(hf)
    assert (ours.bos_id, ours.eos_id) == (hf.bos_token_id, hf.eos_token_id)


def test_llama3_post_processor_bos(llama3_dir):
    tok = load_tokenizer(llama3_dir)
    assert tok.adds_bos and tok.encode("hi")[0] == tok.bos_id
    assert tok.bos_id not in tok.encode("hi", add_special_tokens=False)
    # The template writes BOS itself, so the post-processor must not add a second one.
    ids = tok.apply_chat_template(CHAT)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_add_bos_flags_defer_to_tokenizer_json(tmp_path, make_tokenizer_dir, chatml_dir):
    # transformers 5 ignores the flags when tokenizer.json exists; its post-processor decides.
    path = make_tokenizer_dir(
        tmp_path,
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "add_bos_token": True,
            "add_eos_token": True,
        },
    )
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.encode("Hello there") == hf.encode("Hello there")
    assert not ours.adds_bos and not load_tokenizer(chatml_dir).adds_bos


def test_chat_template_matches_hf(pair):
    ours, hf = pair
    for chat in CHATS:
        for gen in (False, True):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert ids == hf.apply_chat_template(chat, add_generation_prompt=gen)["input_ids"]


def test_tools_and_tojson_match_hf(chatml_dir):
    ours, hf = load_tokenizer(chatml_dir), transformers.AutoTokenizer.from_pretrained(chatml_dir)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "météo",
                "description": "<a & b>",
                "parameters": {"type": "object"},
            },
        }
    ]
    text = ours.apply_chat_template(CHAT[1:2], tools=tools, tokenize=False)
    assert text == hf.apply_chat_template(CHAT[1:2], tools=tools, tokenize=False)
    assert '"météo"' in text and "<a & b>" in text  # no ASCII or HTML escaping


def test_template_variables_and_none_values_match_hf(chatml_dir):
    ours, hf = load_tokenizer(chatml_dir), transformers.AutoTokenizer.from_pretrained(chatml_dir)
    # Multi-line with indented block tags, so trim_blocks and lstrip_blocks matter.
    template = """{{ eos_token }}|{{ bos_token is defined }}|{{ greeting }}|
    {% for m in messages %}
        {% if raise_exception is defined %}
{{ m.tool_calls is defined }}{{ m.reasoning_content }}
        {% endif %}
    {% endfor %}
|{{ strftime_now('%Y') | length }}
{%- set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor -%}
|{{ ns.n }}|{{ dict(a='<&>') | tojson }}|{{ dict.fromkeys(['k']) | tojson }}|
{%- for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}"""
    chat = [{"role": "assistant", "content": "x", "tool_calls": None, "thinking": "hmm"}]
    kwargs = {"chat_template": template, "greeting": "hey", "tokenize": False}
    text = ours.apply_chat_template(chat, **kwargs)
    assert text == hf.apply_chat_template(chat, **kwargs)
    assert text == '<|im_end|>|False|hey|\nFalsehmm\n|4|1|{"a": "<&>"}|{"k": null}|1'
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(chat, chat_template="{% set ns = namespace(_x=1) %}")


def test_generation_tag_mask_matches_hf(generation_dir):
    ours = load_tokenizer(generation_dir)
    hf = transformers.AutoTokenizer.from_pretrained(generation_dir)
    assert ours.chat_template.startswith("{%- for message")  # the .jinja file won
    for chat in CHATS:
        ids, mask = ours.encode_chat(chat)
        ref = hf.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == ref["input_ids"]
        assert [int(m) for m in mask] == ref["assistant_masks"]
        # Without the tags the prefix method must find the same tokens.
        untagged = re.sub(r"\{%-? *(end)?generation *%\}\n", "", ours.chat_template)
        assert "generation %" not in untagged
        assert ours.encode_chat(chat, chat_template=untagged) == (ids, mask)
    ids, mask = ours.encode_chat(CHAT)
    assert (
        ours.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        == "Paris.<|im_end|>Four 🙂, naïvely.<|im_end|>"
    )


@pytest.mark.parametrize(
    "fixture,end", [("chatml_dir", "<|im_end|>"), ("llama3_dir", "<|eot_id|>")]
)
def test_prefix_mask_is_assistant_content_and_end_of_turn(request, fixture, end):
    tok = load_tokenizer(request.getfixturevalue(fixture))
    ids, mask = tok.encode_chat(CHAT)
    assert ids == tok.apply_chat_template(CHAT)
    assert len(mask) == len(ids)
    # Split the masked tokens into maximal runs: one per assistant turn.
    runs, run = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    assert [tok.decode(r, skip_special_tokens=False) for r in runs] == [
        "Paris." + end,
        "Four 🙂, naïvely." + end,
    ]


def test_prefix_mask_rejects_history_rewriting_template(chatml_dir):
    # Like Qwen3: reasoning is rendered for the last assistant turn only.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if loop.last and "
        "m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = load_tokenizer(chatml_dir)
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r1"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "r2"},
    ]
    tok.encode_chat(chat[:2], chat_template=template)  # a single turn is fine
    with pytest.raises(ValueError, match=r"not prefix-stable.*\{% generation %\}"):
        tok.encode_chat(chat, chat_template=template)


def test_special_ids(chatml_dir, llama3_dir):
    chatml, llama = load_tokenizer(chatml_dir), load_tokenizer(llama3_dir)
    vocab = chatml.backend.get_vocab()
    assert chatml.bos_id is None
    assert chatml.eos_ids == (vocab["<|im_end|>"], vocab["<|endoftext|>"])
    assert chatml.pad_id == vocab["<|endoftext|>"]
    assert llama.eos_ids == (vocab["<|eot_id|>"], vocab["<|end_of_text|>"])
    assert llama.pad_id == llama.eos_id == vocab["<|eot_id|>"]  # no pad token: falls back to EOS


def test_named_templates(tmp_path, make_tokenizer_dir, chatml_dir):
    chatml = load_tokenizer(chatml_dir).chat_template
    templates = [
        {"name": "default", "template": chatml},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
        {"name": "plain", "template": "{{ messages[0].content }}"},
    ]
    path = make_tokenizer_dir(tmp_path, {"chat_template": templates})
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert ours.chat_template == chatml
    for kwargs in ({}, {"chat_template": "plain"}, {"tools": [{"name": "f"}]}):
        assert ours.apply_chat_template(CHAT, tokenize=False, **kwargs) == (
            hf.apply_chat_template(CHAT, tokenize=False, **kwargs)
        )
    with pytest.raises(ValueError, match="no chat template named 'nope'.*plain"):
        ours.apply_chat_template(CHAT, chat_template="nope")


def test_load_errors(tmp_path, make_tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")

    bad = make_tokenizer_dir(tmp_path / "bad", {})
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON"):
        load_tokenizer(bad)
    (bad / "tokenizer_config.json").write_text("{}")
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        load_tokenizer(bad)
    (bad / "generation_config.json").unlink()
    (bad / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="tokenizer.json is malformed"):
        load_tokenizer(bad)

    unknown = make_tokenizer_dir(tmp_path / "unknown", {"eos_token": "</s>"})
    with pytest.raises(ValueError, match=r"eos_token='</s>', which is not in the vocabulary"):
        load_tokenizer(unknown)


def test_chat_errors(tmp_path, make_tokenizer_dir, chatml_dir):
    no_template = load_tokenizer(make_tokenizer_dir(tmp_path, {}))
    assert no_template.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*chat_template.jinja.*tokenizer_config"):
        no_template.apply_chat_template(CHAT)

    tok = load_tokenizer(chatml_dir)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with 'role' and 'content'"):
        tok.apply_chat_template([CHAT[0], {"role": "user"}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.encode_chat(["hello"])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.encode_chat([])
    with pytest.raises(ValueError, match="syntax error"):
        tok.apply_chat_template(CHAT, chat_template="{% for %}")


def test_legacy_special_tokens_map(tmp_path, make_tokenizer_dir):
    # Without added_tokens_decoder in the config, special_tokens_map.json overrides it.
    eot = {
        "content": "<|eot_id|>",
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }
    path = make_tokenizer_dir(
        tmp_path,
        {"eos_token": "<|im_end|>"},
        files={
            "special_tokens_map.json": json.dumps({"eos_token": eot, "pad_token": "<|endoftext|>"})
        },
    )
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    assert (ours.eos_id, ours.pad_id) == (hf.eos_token_id, hf.pad_token_id)
    assert ours.special_tokens == {"eos_token": "<|eot_id|>", "pad_token": "<|endoftext|>"}


def test_clean_up_spaces_for_word_level_matches_hf(tmp_path):
    # transformers applies clean_up_tokenization_spaces to non-BPE models only.
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["Hello , world . Is it ?"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "[UNK]",
                "clean_up_tokenization_spaces": True,
            }
        )
    )
    ours, hf = load_tokenizer(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = ours.encode("Hello, world. Is it?")
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "Hello, world. Is it?"


def test_special_token_registration_matches_hf(tmp_path, make_tokenizer_dir, tokenizer_json):
    # Named special tokens become special added tokens, keeping tokenizer.json's flags.
    tj = json.loads(json.dumps(tokenizer_json))
    for token in tj["added_tokens"]:
        token["lstrip"] = token["content"] == "<|eot_id|>"
        token["special"] = token["content"] != "<|endoftext|>"
    word = next(w for w in tj["model"]["vocab"] if w.isascii() and w.isalpha() and len(w) > 2)
    path = make_tokenizer_dir(
        tmp_path,
        {"eos_token": "<|eot_id|>", "pad_token": "<|endoftext|>", "sep_token": word},
        tokenizer_json=tj,
    )
    ours, hf = load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in [" a <|eot_id|> b", "x<|endoftext|>y", f"x{word}y {word}"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.decode(ours.encode("x<|endoftext|>y")) == "xy"


def test_pickles_and_prints_briefly(generation_dir):
    tok = load_tokenizer(generation_dir)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode_chat(CHAT) == tok.encode_chat(CHAT)
    assert "vocab_size=400" in repr(tok) and "endgeneration" not in repr(tok)
