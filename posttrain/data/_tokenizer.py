"""Hugging Face tokenizer directories without transformers: ids, chat templates, loss masks.

`load_tokenizer(dir)` reads tokenizer.json (with the `tokenizers` library), tokenizer_config.json,
chat_template.jinja and generation_config.json. Its `Tokenizer` gives the ids and text that
`transformers.AutoTokenizer.from_pretrained(dir)` (transformers 5, generic fast tokenizer) gives,
and `encode_chat` adds the mask of assistant tokens that SFT computes its loss on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from posttrain import paths
from posttrain.data._chat_template import (
    GENERATION_TAG,
    Spans,
    check_messages,
    compile_template,
    generation_spans,
)

_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_TEMPLATE_PLACES = (
    "chat_template.jinja, additional_chat_templates/*.jinja and the "
    "'chat_template' key of tokenizer_config.json"
)
_CLEANUP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _overlap_mask(offsets: Sequence[tuple[int, int]], spans: Spans) -> list[bool]:
    """Marks each token whose character span overlaps one of the (sorted) spans, as HF does."""
    mask, s = [False] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        mask[t] = end > spans[s][0]
    return mask


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A Hugging Face tokenizer with its chat templates; build it with `load_tokenizer`.

    Attributes:
      backend: the `tokenizers.Tokenizer` (for offsets, vocab lookups, ...).
      name_or_path: the directory it was loaded from.
      vocab_size: number of ids including added tokens (`len(hf_tokenizer)`).
      bos_id, eos_id, unk_id: ids of the config's special tokens; None where it sets none.
      eos_ids: every id generation stops on: `eos_id`, then generation_config's `eos_token_id`.
      pad_id: the pad token's id, else `eos_id` (pads are masked out of every loss, so reusing
        EOS is safe), else None.
      chat_template: the default chat template; None if the directory has none.
      chat_templates: every chat template by name ("default", "tool_use", ...).
      special_tokens: named special tokens ({"eos_token": "<|im_end|>", ...}), template variables.
      clean_up_tokenization_spaces: the config's flag; transformers applies it to non-BPE models.

    The mappings are plain dicts, so that a tokenizer pickles to data-loader workers; treat them
    as read-only.
    """

    backend: tokenizers.Tokenizer = dataclasses.field(repr=False)
    name_or_path: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    unk_id: int | None
    chat_template: str | None = dataclasses.field(repr=False)
    chat_templates: Mapping[str, str] = dataclasses.field(repr=False)
    special_tokens: Mapping[str, str]
    clean_up_tokenization_spaces: bool = False

    @property
    def adds_bos(self) -> bool:
        """Whether `encode(text)` prepends BOS (tokenizer.json's post-processor, Llama-3 style)."""
        return self.bos_id is not None and self.encode("")[:1] == [self.bos_id]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text to ids.

        Args:
          text: the string; special-token strings in it become their ids.
          add_special_tokens: apply tokenizer.json's post-processor (e.g. prepend BOS).

        Returns:
          The token ids.
        """
        if len(text) > 65536:  # (the batch call lets other threads run meanwhile: a server's)
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def max_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string's length, which
        byte-level and SentencePiece vocabularies never undercut): a text of more than
        n x this characters holds more than n tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """`encode` of each string, in parallel in the `tokenizers` backend."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids to text.

        Args:
          ids: token ids.
          skip_special_tokens: leave special tokens (BOS, EOS, chat markers) out of the text.

        Returns:
          The text.
        """
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._clean_up(text)

    def decode_batch(
        self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each id sequence."""
        texts = self.backend.decode_batch(
            [list(ids) for ids in batch], skip_special_tokens=skip_special_tokens
        )
        return [self._clean_up(t) for t in texts]

    def _clean_up(self, text: str) -> str:
        # transformers skips this WordPiece-era cleanup for BPE models, where it corrupts text.
        if self.clean_up_tokenization_spaces and type(self.backend.model).__name__ != "BPE":
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with a chat template, as transformers' method of that name.

        Args:
          messages: dicts with 'role' and 'content' (and any other keys the template reads).
          add_generation_prompt: end with the header that opens an assistant turn.
          tokenize: return the ids of the text, encoded without special tokens (the template
            writes BOS itself), instead of the text.
          tools: JSON-schema dicts; they select the "tool_use" template if there is one.
          chat_template: the name of one of `chat_templates`, or a jinja template.
          **template_kwargs: extra template variables (e.g. enable_thinking=False).

        Returns:
          The rendered text, or its ids.
        """
        template = self._template(chat_template, tools)
        text, _ = self._render(
            template, check_messages(messages), add_generation_prompt, tools, template_kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[bool]]:
        """Tokenizes a conversation and marks its assistant tokens (those SFT computes loss on).

        With `{% generation %}` blocks in the template, the mask covers what they render (as
        HF's `return_assistant_tokens_mask`). Otherwise each assistant message covers the text
        between the render of the messages before it with the generation prompt and the render
        through it, trailing whitespace excluded: its content and end-of-turn token(s).

        Args:
          messages, tools, chat_template, template_kwargs: as in `apply_chat_template`.

        Returns:
          (ids, mask): the ids of `apply_chat_template(messages)`, and per id whether it is an
          assistant token.

        Raises:
          ValueError: the template has no generation tags and is not prefix-stable (it rewrites
            earlier turns as later ones are added), so assistant text cannot be located.
        """
        template = self._template(chat_template, tools)
        msgs = check_messages(messages)
        text, spans = self._render(template, msgs, False, tools, template_kwargs, track=True)
        if not GENERATION_TAG.search(template):
            spans = self._prefix_spans(template, msgs, text, tools, template_kwargs)
        encoding = self.backend.encode(text, add_special_tokens=False)
        return encoding.ids, _overlap_mask(encoding.offsets, spans)

    def _prefix_spans(self, template, msgs, text, tools, kwargs) -> Spans:
        """Assistant spans of `text`, found by rendering growing prefixes of the conversation."""
        spans = []
        for i, message in enumerate(msgs):
            if message["role"] != "assistant":
                continue
            prompt, _ = self._render(template, msgs[:i], True, tools, kwargs)
            through, _ = self._render(template, msgs[: i + 1], False, tools, kwargs)
            if not (through.startswith(prompt) and text.startswith(through)):
                raise ValueError(
                    f"chat template is not prefix-stable: messages[:{i}] with the generation "
                    f"prompt, or messages[:{i + 1}], does not render to a prefix of the whole "
                    "conversation (the template rewrites earlier turns, e.g. drops past "
                    "reasoning, or its generation prompt differs from a rendered assistant turn), "
                    "so assistant tokens cannot be located. Wrap each assistant "
                    "turn's content and end-of-turn token in {% generation %}...{% endgeneration "
                    "%} in the template."
                )
            # The newline templates put after end-of-turn is never generated (generation stops
            # at end-of-turn), so it stays out of the loss.
            spans.append((len(prompt), max(len(prompt), len(through.rstrip()))))
        return spans

    def _template(self, name_or_template: str | None, tools) -> str:
        """The template to render, chosen with transformers' precedence."""
        templates = self.chat_templates
        if name_or_template is not None:
            if name_or_template in templates:
                return templates[name_or_template]
            if "{" not in name_or_template:
                raise ValueError(
                    f"no chat template named {name_or_template!r} in "
                    f"{self.name_or_path}; available: {sorted(templates)}"
                )
            return name_or_template
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        if templates:
            raise ValueError(
                f"{self.name_or_path} has several chat templates, none named "
                f"'default'; pass chat_template= one of {sorted(templates)}"
            )
        raise ValueError(
            f"{self.name_or_path} has no chat template (looked in {_TEMPLATE_PLACES})"
            "; add chat_template.jinja there or pass chat_template='<jinja template>'"
        )

    def _render(
        self, template, msgs, add_generation_prompt, tools, kwargs, track=False
    ) -> tuple[str, Spans]:
        """The rendered text and, with track=True, the spans of its {% generation %} blocks."""
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("tools must be JSON-schema dicts ({'type': 'function', ...})")
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": msgs,
            "tools": tools,
            "documents": kwargs.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        chunks: list[str] = []
        spans: Spans = []
        token = generation_spans.set((chunks, spans) if track else None)
        try:
            # Rendering chunk by chunk is what tells _GenerationTracker where a block starts.
            for chunk in compile_template(template).generate(**variables):
                chunks.append(chunk)
        finally:
            generation_spans.reset(token)
        return "".join(chunks), spans


def _read_json(path: Path) -> dict:
    """The JSON object in `path`; {} if there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _read_templates(root: Path, config: dict) -> dict[str, str]:
    """Chat templates by name; as in transformers, template files replace the config's."""
    files = {
        p.stem: p.read_text(encoding="utf-8")
        for p in sorted((root / "additional_chat_templates").glob("*.jinja"))
    }
    if (root / "chat_template.jinja").is_file():
        files["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    raw = config.get("chat_template")
    if files or raw is None:
        return files
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list) and all(
        isinstance(t, dict) and {"name", "template"} <= t.keys() for t in raw
    ):
        return {t["name"]: t["template"] for t in raw}
    raise ValueError(
        f"{root / 'tokenizer_config.json'}: 'chat_template' must be a string or "
        "a list of {'name': ..., 'template': ...} dicts"
    )


_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".gguf")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Loads a Hugging Face tokenizer directory (as written by `save_pretrained`).

    Args:
      path: a directory with tokenizer.json, and optionally tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja, additional_chat_templates/ and
        generation_config.json.

    Returns:
      The `Tokenizer`.

    Raises:
      FileNotFoundError: the directory or its tokenizer.json is missing.
      ValueError: a file is malformed, or a configured special token is not in the vocabulary.
    """
    if paths.is_remote(path):  # gs://: a cached local copy (tokenizers read local files)
        if not paths.path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        # (a model directory's weights stay in the bucket: from_hf reads them in place)
        path = paths.local_copy(path, skip=_WEIGHT_FILES)
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {root} does not exist; pass the directory "
            "that holds tokenizer.json"
        )
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{root} has no tokenizer.json; only fast tokenizers are "
            "supported (write one with transformers' save_pretrained)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{root / 'tokenizer.json'} is malformed ({e}); re-save it") from e
    config = _read_json(root / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:  # legacy layout: this file overrides, as in HF
        config = {**config, **_read_json(root / "special_tokens_map.json")}
    generation = _read_json(root / "generation_config.json")

    special, added = {}, []
    known = {t.content: t for t in backend.get_added_tokens_decoder().values()}
    for name in _SPECIAL_NAMES:
        value = config.get(name)
        content = value.get("content") if isinstance(value, dict) else value
        if content is None:
            continue
        if not isinstance(content, str) or backend.token_to_id(content) is None:
            raise ValueError(
                f"the tokenizer config sets {name}={content!r}, which is not in the "
                f"vocabulary of {root / 'tokenizer.json'}; fix the token in "
                "tokenizer_config.json (or special_tokens_map.json) or add it to "
                "tokenizer.json's added_tokens"
            )
        special[name] = content
        # transformers makes every named special token a special added token: split off before
        # pre-tokenization even if tokenizer.json has it as a plain vocabulary entry, and
        # dropped by skip_special_tokens even if tokenizer.json marks it non-special.
        if (old := known.get(content)) is None:
            flags = {
                k: value[k]
                for k in ("single_word", "lstrip", "rstrip")
                if isinstance(value, dict) and k in value
            }
            added.append(tokenizers.AddedToken(content, special=True, normalized=False, **flags))
        elif not old.special:
            added.append(
                tokenizers.AddedToken(
                    content,
                    single_word=old.single_word,
                    lstrip=old.lstrip,
                    rstrip=old.rstrip,
                    normalized=old.normalized,
                    special=True,
                )
            )
    backend.add_special_tokens(added)
    ids = {name: backend.token_to_id(content) for name, content in special.items()}
    # add_bos_token/add_eos_token are ignored, as transformers 5 ignores them when tokenizer.json
    # exists: its post-processor alone decides what encode() adds (see `adds_bos`). Nor does
    # transformers truncate or pad unless asked, whatever tokenizer.json says.
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    stop = generation.get("eos_token_id")
    stop = [] if stop is None else [stop] if isinstance(stop, int) else stop
    if not isinstance(stop, list) or not all(
        isinstance(i, int) and 0 <= i < vocab_size for i in stop
    ):
        raise ValueError(
            f"{root / 'generation_config.json'}: eos_token_id must be an id or a "
            f"list of ids below the vocabulary size {vocab_size}, got {stop!r}"
        )
    eos_id = ids.get("eos_token")
    templates = _read_templates(root, config)
    return Tokenizer(
        backend=backend,
        name_or_path=str(root),
        vocab_size=vocab_size,
        bos_id=ids.get("bos_token"),
        eos_id=eos_id,
        eos_ids=tuple(dict.fromkeys(i for i in (eos_id, *stop) if i is not None)),
        pad_id=ids.get("pad_token", eos_id),
        unk_id=ids.get("unk_token"),
        chat_template=templates.get("default"),
        chat_templates=templates,
        special_tokens=special,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
    )
