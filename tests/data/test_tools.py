"""posttrain.data._tools: tool schemas against transformers, tool calls through real templates.

The chat templates in tests/data/templates/ are the models' official ones, verbatim:

- qwen2_5.jinja: Qwen/Qwen2.5-7B-Instruct (tokenizer_config.json's chat_template), as vendored in
  huggingface/huggingface.js, packages/jinja/test/e2e.test.js (commit fe42e680), under the key
  "Qwen/Qwen2.5-7B-Instruct".
- llama3_1.jinja: meta-llama/Llama-3.1-8B-Instruct, same file, key
  "meta-llama/Llama-3.1-8B-Instruct".
- mistral_v3.jinja: mistralai/Mistral-7B-Instruct-v0.3 (the [AVAILABLE_TOOLS] / [TOOL_CALLS] /
  [TOOL_RESULTS] template with 9-character tool-call ids), as quoted in public code that renders
  it (a chat-template explorer labelling it "mistralai/Mistral-7B-Instruct-v0.3", and a
  tool-grammar table keyed by "lmstudio-community/Mistral-7B-Instruct-v0.3-GGUF"); the copies
  agree character for character.
"""

import enum
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pytest
import transformers
from transformers.utils import get_json_schema

from posttrain.data import (
    TOOL_FORMATS,
    ParsedTurn,
    load_tokenizer,
    parse_tool_calls,
    register_tool_format,
    tool_format_for,
    tool_schema,
)
from posttrain.data._turns import Turns
from tests.data.conftest import _write_dir, train_tokenizer_json

TEMPLATES = Path(__file__).parent / "templates"

# Every control token the three templates write, so each renders to single special ids.
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]  # fmt: skip

# format name -> (template file, tokenizer_config specials, end-of-turn text, parallel calls)
MODELS = {
    "hermes": (
        "qwen2_5.jinja",
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "<|im_end|>\n",
        True,
    ),
    "llama3_json": (
        "llama3_1.jinja",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|eot_id|>",
        False,  # Llama 3.1's template raises on more than one call per message
    ),
    "mistral": (
        "mistral_v3.jinja",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "</s>",
        True,
    ),
}


def get_weather(city: str, unit: str = "celsius") -> float:
    """Get the current temperature in a city.

    Args:
        city: The city, e.g. "Paris".
        unit: The unit to answer in. (choices: ["celsius", "fahrenheit"])

    Returns:
        The temperature.
    """
    return 21.0


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


def kitchen_sink(
    name: str,
    count: int,
    ratio: float = 0.5,
    flag: bool = False,
    tags: list[str] | None = None,
    grid: list[list[int]] = (),
    scores: dict[str, float] = None,
    raw: dict = None,
    pair: tuple[int, str] = (0, ""),
    either: Union[int, str] = 0,  # noqa: UP007 (typing.Union, not X | Y, on purpose)
    mixed: Union[list[int], str] = "",  # noqa: UP007
    maybe: Optional[float] = None,  # noqa: UP045
    mode: Literal["fast", "slow", 3] = "fast",
    color: Color = Color.RED,
    anything: Any = None,
):
    """Exercise every type hint.

    A second paragraph of description.

    Args:
        name: A name
            that continues on the next line.
        count (int): How many. (choices: [1, 2, 3])
        ratio: A ratio.
        flag: A flag.
        tags: Tags.
        grid: A grid.
        scores: Scores by name.
        raw: Any object.
        pair: A pair.
        either: An int or a string.
        mixed: A list or a string.
        maybe: Maybe a number.
        mode: The mode.
        color: A color.
        anything: Anything.

    Raises:
        ValueError: never.
    """


class Searcher:
    def search(self, query: str, limit: int = 10) -> list[str]:
        """Search the web.

        Args:
            query: What to look for.
            limit: At most this many results.

        Returns:
            The result titles.
        """
        return []


@pytest.mark.parametrize("fn", [get_weather, add, kitchen_sink, Searcher().search])
def test_schema_matches_transformers(fn):
    ours = tool_schema(fn)
    assert ours == get_json_schema(fn)
    assert json.dumps(ours) == json.dumps(get_json_schema(fn))  # key order too: templates tojson


def test_schema_errors_name_the_function_and_parameter():
    def untyped(city):
        """Doc.

        Args:
            city: The city.
        """

    def undocumented(city: str):
        pass

    def undescribed(city: str, days: int):
        """Doc.

        Args:
            city: The city.
        """

    def custom(thing: Searcher):
        """Doc.

        Args:
            thing: A thing.
        """

    with pytest.raises(ValueError, match="'untyped': parameter 'city' has no type hint"):
        tool_schema(untyped)
    with pytest.raises(ValueError, match="'undocumented' has no docstring"):
        tool_schema(undocumented)
    with pytest.raises(ValueError, match="'undescribed': parameter 'days' has no description"):
        tool_schema(undescribed)
    with pytest.raises(ValueError, match="'custom', parameter 'thing'.*no JSON schema"):
        tool_schema(custom)


@pytest.fixture(scope="module")
def tool_tokenizer_json() -> dict:
    """A byte-level BPE (vocab 400) whose added tokens are all three templates' control tokens."""
    return train_tokenizer_json(SPECIAL)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tool_tokenizer_json) -> dict[str, Path]:
    """A tokenizer directory per tool format, with that model's official chat template."""
    dirs = {}
    for fmt, (template, specials, _, _) in MODELS.items():
        config = {**specials, "chat_template": (TEMPLATES / template).read_text()}
        dirs[fmt] = _write_dir(tmp_path_factory.mktemp(fmt), tool_tokenizer_json, config)
    return dirs


@pytest.fixture(scope="module")
def tokenizers_by_format(model_dirs):
    """(ours, transformers') tokenizer per format."""
    return {
        fmt: (load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path))
        for fmt, path in model_dirs.items()
    }


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "How warm is Paris, and what is 2 + 3?"},
]


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_prompt_with_tools_matches_transformers(tokenizers_by_format, fmt):
    ours, hf = tokenizers_by_format[fmt]
    tools = [tool_schema(get_weather), tool_schema(add)]
    kwargs = {"add_generation_prompt": True}
    text = ours.apply_chat_template(CHAT, tools=tools, tokenize=False, **kwargs)
    # transformers builds the schemas from the functions itself.
    assert text == hf.apply_chat_template(CHAT, tools=[get_weather, add], tokenize=False, **kwargs)
    assert "get_weather" in text and "The first." in text
    ids = ours.apply_chat_template(CHAT, tools=tools, **kwargs)
    assert ids == hf.apply_chat_template(CHAT, tools=[get_weather, add], **kwargs)["input_ids"]


def _calls(parallel: bool) -> list[dict]:
    calls = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"name": "add", "arguments": {"a": 2, "b": 3}},
    ]
    return calls if parallel else calls[:1]


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_native_calls_parse_back(tokenizers_by_format, fmt):
    ours, hf = tokenizers_by_format[fmt]
    _, _, end_of_turn, parallel = MODELS[fmt]
    content = "Let me check." if fmt == "hermes" else ""  # the others drop it beside calls
    calls = _calls(parallel)
    assistant = {
        "role": "assistant",
        "content": content,
        # Mistral's template accepts only 9-character ids.
        "tool_calls": [
            {"id": f"call{i:05d}", "type": "function", "function": c} for i, c in enumerate(calls)
        ],
    }
    # No system message: Mistral's template puts it in the last user message, so the prompt
    # would not be a prefix of the conversation.
    chat, tools = CHAT[1:], [get_weather, add]
    prompt = hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    full = hf.apply_chat_template([*chat, assistant], tools=tools, tokenize=False)
    schemas = [tool_schema(get_weather), tool_schema(add)]
    assert full == ours.apply_chat_template([*chat, assistant], tools=schemas, tokenize=False)
    assert full.startswith(prompt) and full.endswith(end_of_turn)
    turn = parse_tool_calls(full[len(prompt) : -len(end_of_turn)], fmt)
    assert turn.errors == [] and turn.content == content
    assert [c["function"] for c in turn.tool_calls] == calls
    assert all(c["type"] == "function" for c in turn.tool_calls)
    ids = [c["id"] for c in turn.tool_calls]
    assert len(set(ids)) == len(ids)
    if fmt == "mistral":  # the model's own valid ids are kept
        assert ids == [f"call{i:05d}" for i in range(len(calls))]


def test_parsed_calls_render_again(tokenizers_by_format):
    """Parsed calls are what templates render an assistant message from (arguments as dicts)."""
    ours, hf = tokenizers_by_format["mistral"]
    turn = parse_tool_calls(
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}}]', "mistral"
    )
    [call] = turn.tool_calls
    assert len(call["id"]) == 9 and call["id"].isalnum()
    chat = [*CHAT, {"role": "assistant", "content": "", "tool_calls": turn.tool_calls}]
    text = ours.apply_chat_template(chat, tokenize=False)
    assert text == hf.apply_chat_template(chat, tokenize=False)
    rendered = json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}, "id": call["id"]})
    assert text.endswith(f"[TOOL_CALLS] [{rendered}]</s>")


@pytest.mark.parametrize("fmt", sorted(MODELS))
def test_format_for_template(fmt):
    assert tool_format_for((TEMPLATES / MODELS[fmt][0]).read_text()) == fmt


def test_format_for_unknown_template_is_hermes():
    assert tool_format_for("{{ messages[0]['content'] }}") == "hermes"
    llama3_without_tools = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}"
    assert tool_format_for(llama3_without_tools) == "hermes"


MALFORMED = {
    "hermes": [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "is a JSON array"),
        ('<tool_call>["add"]</tool_call>', "is a JSON array, not an object"),
        ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}', "no closing </tool_call>"),
    ],
    "llama3_json": [
        ('{"name": "add", "parameters": {"a": 1,}}', "not valid JSON"),
        ('{"parameters": {"a": 1}}', 'no "name"'),
        ('{"name": "add", "parameters": "a=1"}', '"parameters" string is not JSON'),
        ("<|python_tag|>brave_search.call(query='x')", "not valid JSON"),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
        ('[TOOL_CALLS] [{"arguments": {"a": 1}}]', 'no "name"'),
        ('[TOOL_CALLS] [{"name": "add", "arguments": 3}]', "is a JSON number"),
    ],
}


@pytest.mark.parametrize(
    "fmt,text,error", [(fmt, t, e) for fmt, cases in MALFORMED.items() for t, e in cases]
)
def test_malformed_calls_are_errors_not_calls(fmt, text, error):
    turn = parse_tool_calls(text, fmt)
    assert turn.tool_calls == []
    [message] = turn.errors
    assert message.startswith("tool call") and error in message
    assert turn.content == text.strip().removeprefix("<|python_tag|>")  # the text stays text


def test_error_message_names_call_and_position():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name" "b"}</tool_call>'
    )
    turn = parse_tool_calls(text, "hermes")
    assert [c["function"]["name"] for c in turn.tool_calls] == ["a"]
    assert turn.errors == ["tool call 2 is not valid JSON: Expecting ':' delimiter at char 8"]
    assert turn.content == '<tool_call>{"name" "b"}</tool_call>'  # valid blocks leave content


def test_plain_text_has_no_calls_and_no_errors():
    for fmt in MODELS:
        assert parse_tool_calls("  Paris is 21 degrees.\n", fmt) == ParsedTurn(
            "Paris is 21 degrees.", [], []
        )


def test_llama3_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    turn = parse_tool_calls(text, "llama3_json")
    assert [c["function"] for c in turn.tool_calls] == [
        {"name": "a", "arguments": {"x": 1}},
        {"name": "b", "arguments": {}},
    ]
    assert turn.content == "" and turn.errors == []
    assert all(c["id"].startswith("call_") for c in turn.tool_calls)


def test_mistral_ids_and_content_before_the_calls():
    text = 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    turn = parse_tool_calls(text, "mistral")
    assert turn.content == "Checking." and turn.errors == []
    ids = [c["id"] for c in turn.tool_calls]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2


def test_registry():
    assert {"hermes", "llama3_json", "mistral"} <= set(TOOL_FORMATS)
    with pytest.raises(ValueError, match="unknown tool format 'nope'"):
        parse_tool_calls("", "nope")
    with pytest.raises(ValueError, match="already registered"):
        register_tool_format("hermes", lambda text: ParsedTurn(text, [], []))
    register_tool_format("hermes", TOOL_FORMATS["hermes"])  # the same parser again is fine

    def shouty(text):
        return ParsedTurn(text.upper(), [], [])

    register_tool_format("test_shouty", shouty)
    try:
        assert parse_tool_calls("hi", "test_shouty").content == "HI"
    finally:
        del TOOL_FORMATS["test_shouty"]


def _tool_trajectory() -> list[dict]:
    call = {"id": "call00000", "type": "function", "function": _calls(False)[0]}
    return [
        *CHAT,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call00000", "content": "21.5"},
        {"role": "assistant", "content": "It is 21.5 degrees."},
    ]


def test_tool_trajectory_trains_on_the_assistant_turns_only(tokenizers_by_format):
    """SFT on a multi-turn tool-use record ({"messages", "tools"}) with Qwen2.5's template: the
    ids are transformers', the loss covers the call and the answer, never the tool's result."""
    ours, hf = tokenizers_by_format["hermes"]
    messages, schemas = _tool_trajectory(), [tool_schema(get_weather), tool_schema(add)]
    ids, mask = ours.encode_chat(messages, tools=schemas)
    assert ids == hf.apply_chat_template(messages, tools=[get_weather, add])["input_ids"]
    spans, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(ours.decode(current, skip_special_tokens=False))
            current = []
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    assert spans == [
        f"<tool_call>\n{call}\n</tool_call><|im_end|>",
        "It is 21.5 degrees.<|im_end|>",
    ]


def test_turns_extend_the_official_template_token_in_token_out(tokenizers_by_format):
    """`Turns` on Qwen2.5's template: prompt + the model's turn + the observation's ids equal
    the template's rendering of the whole conversation."""
    ours, _ = tokenizers_by_format["hermes"]
    messages, schemas = _tool_trajectory(), [tool_schema(get_weather), tool_schema(add)]
    turns = Turns(ours, schemas)
    ids = turns.prompt(messages[:2])
    rendered = turns.render(messages[:3], generation_prompt=False)
    sampled = rendered[len(turns.render(messages[:2], generation_prompt=True)) :]
    ids += turns.encode(sampled.removesuffix("\n"))  # the model stops at <|im_end|>
    ids += turns.observation(messages[:3], messages[3:4])
    full = ours.apply_chat_template(messages[:4], add_generation_prompt=True, tools=schemas)
    assert ids == full
