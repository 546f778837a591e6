"""A small byte-level BPE tokenizer learnt on a corpus, for a model trained from scratch (the
demos' tokenizers, `posttrain data cad`'s), written as a Hugging Face tokenizer directory that
`posttrain.data.load_tokenizer` and `AutoTokenizer.from_pretrained` read; and the two chat
templates those tokenizers ship: ChatML, and ChatML with tools."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512  # the `tiny` model preset's vocab_size
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's ChatML without the default system turn, which would only lengthen every sequence.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML with tools (a "Tool:" line per tool in the system turn), assistant tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (the "hermes" format) and tool
# results as their own turns: compact enough for the tiny model's context.
TOOL_CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set ns.first = 1 %}{%- endif %}"
    "{%- if tools or ns.first %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if ns.first %}{{- messages[0]['content'] }}{%- endif %}"
    "{%- for tool in tools or [] %}"
    "{{- '\\nTool: ' + tool['function']['name'] + ' - ' + tool['function']['description'] }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[ns.first:] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(
    out_dir: str | Path, texts: Iterable[str], *, chat_template: str = CHATML_TEMPLATE
) -> str:
    """Trains a tokenizer on `texts` and writes it as a Hugging Face tokenizer directory.

    Byte-level BPE with exactly `VOCAB_SIZE` entries: the special tokens <|endoftext|> (pad),
    <|im_start|> and <|im_end|> (EOS), the 256 bytes, and merges learnt on `texts`. Digits are
    always single tokens, so "936" is 9, 3, 6. The same texts give the same bytes.

    Args:
      out_dir: the directory to write tokenizer.json and tokenizer_config.json into.
      texts: what the merges are learnt on; it must offer enough distinct pairs to reach
        `VOCAB_SIZE`.
      chat_template: the chat template to ship.

    Returns:
      The directory.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Untrimmed offsets keep each token's span exact, which assistant masks are computed from.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if (size := tokenizer.get_vocab_size(with_added_tokens=True)) != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {size} tokens, not {VOCAB_SIZE}; add more text")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.dumps(_config(chat_template), indent=2, sort_keys=True)
    (out / "tokenizer_config.json").write_bytes((config + "\n").encode("utf-8"))
    return str(out)


def _config(chat_template: str) -> dict:
    """tokenizer_config.json: Qwen's special-token roles and the chat template."""
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
