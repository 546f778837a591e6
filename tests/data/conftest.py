"""Tiny Hugging Face tokenizer directories, built on the fly (no hub access in tests)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you doing today?",
    "I am fine, thank you. What about you?",
    "Post-training teaches a language model to follow instructions.",
    "Supervised fine-tuning computes the loss on assistant tokens only.",
    "Direct preference optimisation compares a chosen and a rejected answer.",
    "The reward model scores each completion with a single number.",
    "What is the capital of France? The capital of France is Paris.",
    "Two plus two equals four, and three times three equals nine.",
    "Write a short poem about the sea and the wind.",
    "The sea is wide, the wind is free, the waves come rolling in to me.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "system user assistant tool function arguments name content",
    "def add(a, b):\n    return a + b\n",
    "Naïve café résumé — déjà vu, über straße, 東京 and 北京, emoji 🙂🚀.",
    "JAX compiles functions with XLA and shards arrays across devices.",
    "Tokenizers split text into pieces and map each piece to an id.",
    "The weather is sunny with a light breeze in the afternoon.",
    "Please summarise the following paragraph in one sentence.",
    "Sure! Here is a summary of the paragraph you gave me.",
] * 3

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Meta's Llama-3 instruct template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

GENERATION_TEMPLATE = """\
{%- for message in messages %}
{%- if message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- generation %}
{{- message['content'] + '<|im_end|>' }}
{%- endgeneration %}
{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


@pytest.fixture(scope="session")
def tokenizer_json() -> dict:
    """A byte-level BPE tokenizer (vocab 400) as tokenizer.json's dict."""
    return train_tokenizer_json(SPECIAL_TOKENS)


def train_tokenizer_json(special_tokens) -> dict:
    """A byte-level BPE (vocab 400) trained on the corpus, with `special_tokens` added."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    return json.loads(tok.to_str())


def _write_dir(path, tokenizer_json, config, *, post_processor=None, files=None):
    """Writes tokenizer.json (optionally another post-processor), tokenizer_config.json, files."""
    path.mkdir(parents=True, exist_ok=True)
    tok = dict(tokenizer_json)
    if post_processor is not None:
        tok["post_processor"] = json.loads(post_processor.__getstate__())
    (path / "tokenizer.json").write_text(json.dumps(tok))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


@pytest.fixture(scope="session")
def make_tokenizer_dir(tokenizer_json):
    """`make(path, config, *, post_processor=None, files=None, tokenizer_json=...)` writes one."""
    return lambda path, config, tokenizer_json=tokenizer_json, **kwargs: _write_dir(
        path, tokenizer_json, config, **kwargs
    )


@pytest.fixture(scope="session")
def chatml_dir(tmp_path_factory, tokenizer_json):
    """Qwen-style: no BOS, ChatML template in tokenizer_config.json, two stop ids."""
    return _write_dir(
        tmp_path_factory.mktemp("chatml"),
        tokenizer_json,
        {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        },
        files={"generation_config.json": json.dumps({"eos_token_id": [2, 0]})},
    )


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory, tokenizer_json):
    """Llama-3-style: the post-processor prepends BOS, AddedToken dicts, no pad token."""
    bos_id = SPECIAL_TOKENS.index("<|begin_of_text|>")
    post = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos_id)],
            ),
        ]
    )
    token = {
        "content": "<|begin_of_text|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
        "__type": "AddedToken",
    }
    return _write_dir(
        tmp_path_factory.mktemp("llama3"),
        tokenizer_json,
        {"bos_token": token, "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
        post_processor=post,
        files={"generation_config.json": json.dumps({"eos_token_id": [4, 7]})},
    )


@pytest.fixture(scope="session")
def generation_dir(tmp_path_factory, tokenizer_json):
    """ChatML with {% generation %} tags, in the newer chat_template.jinja layout."""
    return _write_dir(
        tmp_path_factory.mktemp("generation"),
        tokenizer_json,
        {"eos_token": "<|im_end|>", "chat_template": "ignored: chat_template.jinja wins"},
        files={"chat_template.jinja": GENERATION_TEMPLATE},
    )


def write_records(path, records):
    """Writes records to `path` as JSON lines, Parquet or ArrayRecord (by suffix); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(dict.fromkeys(k for r in records for k in r))  # a column for every key
        rows = [{k: r.get(k) for k in keys} for r in records]
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    elif path.suffix == ".arrayrecord":
        from array_record.python.array_record_module import ArrayRecordWriter

        writer = ArrayRecordWriter(str(path), "group_size:1")
        for record in records:
            writer.write(record if isinstance(record, bytes) else json.dumps(record).encode())
        writer.close()
    else:
        path.write_text(
            "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
        )
    return path


@pytest.fixture(scope="session")
def chatml(chatml_dir):
    """The ChatML tokenizer (no BOS, EOS <|im_end|>, pad <|endoftext|>), loaded."""
    from posttrain.data import load_tokenizer

    return load_tokenizer(chatml_dir)


@pytest.fixture(scope="session")
def llama3(llama3_dir):
    """The Llama-3-style tokenizer (BOS from the post-processor, EOS <|eot_id|>), loaded."""
    from posttrain.data import load_tokenizer

    return load_tokenizer(llama3_dir)
