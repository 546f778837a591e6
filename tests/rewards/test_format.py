"""Structure rewards: tag layout, tool calls against JSON schemas, over-length penalty."""

import json

import numpy as np
import pytest

from posttrain.rewards import check_format, format_reward, overlong_penalty, tool_call_reward


@pytest.mark.parametrize(
    "text,reason",
    [
        ("<think>x</think><answer>4</answer>", None),
        ("  <think>\nlong thought\n</think>\n\n<answer> 4 </answer>\n", None),
        ("<answer>4</answer>", "missing <think>"),
        ("<think>x</think>", "missing <answer>"),
        ("<think>x</think><answer>4", "missing </answer>"),
        ("<think>x</think><answer>4</answer><answer>5</answer>", "<answer> appears 2 times"),
        ("<answer>4</answer><think>x</think>", "<answer> must come after </think>"),
        ("<think>x<answer>4</answer></think>", "<answer> must come after </think>"),
        ("</think>x<think><answer>4</answer>", "</think> comes before <think>"),
        ("<think>x</think><answer> </answer>", "<answer> is empty"),
        ("Sure! <think>x</think><answer>4</answer>", "text outside the tags: 'Sure!'"),
        ("<think>x</think> so <answer>4</answer>", "text outside the tags: 'so'"),
        ("<think>x</think><answer>4</answer> done", "text outside the tags: 'done'"),
    ],
)
def test_check_format(text, reason):
    got = check_format(text)
    assert got == reason if reason is None else got.startswith(reason), got


def test_format_reward_tags_from_argument_or_record():
    text = "<reasoning>r</reasoning><solution>s</solution>"
    assert format_reward({}, text) == (0.0, {"reason": "missing <think>"})
    assert format_reward({}, text, tags=("reasoning", "solution")) == (1.0, {})
    assert format_reward({"format_tags": ["reasoning", "solution"]}, text) == (1.0, {})
    assert format_reward({"format_tags": ["answer"]}, "<answer>1</answer>") == (1.0, {})


WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1},
            "unit": {"enum": ["C", "F"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now", "parameters": {}}}]


def _call(name="get_weather", **arguments):
    call = json.dumps({"name": name, "arguments": arguments})
    return f"Let me check.\n<tool_call>{call}</tool_call>"


@pytest.mark.parametrize(
    "completion,reason",
    [
        (_call(city="Paris"), None),
        (_call(city="Paris", days=3, unit="C"), None),
        (_call("now"), None),  # OpenAI-style tool entry
        ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', None),  # string arguments
        ("I'll just answer: 20C", "no <tool_call> block"),
        (_call(city="A") + _call(city="B"), "2 <tool_call> blocks"),
        ("<tool_call>{'name': 'now'}</tool_call>", "invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "the call is a JSON list"),
        ('<tool_call>{"arguments": {}}</tool_call>', "missing 'name'"),
        ('<tool_call>{"name": "now", "arguments": [1]}</tool_call>', "'arguments' is a list"),
        ('<tool_call>{"name": "now", "arguments": "{oops"}</tool_call>', "'arguments' string is"),
        (_call("get_forecast", city="Paris"), "unknown tool 'get_forecast'"),
        (_call(days=3), "schema violation at arguments: 'city' is a required property"),
        (_call(city=7), "schema violation at city: 7 is not of type 'string'"),
        (_call(city="Paris", days=0), "schema violation at days: 0 is less than the minimum"),
        (_call(city="Paris", unit="K"), "schema violation at unit: 'K' is not one of"),
        (_call(city="Paris", country="FR"), "schema violation at arguments: Additional"),
    ],
)
def test_tool_call_reward(completion, reason):
    score, info = tool_call_reward({"tools": TOOLS}, completion)
    if reason is None:
        assert score == 1.0 and "reason" not in info, info
    else:
        assert score == 0.0 and info["reason"].startswith(reason), info


def test_tool_call_expected_call():
    record = {
        "tools": TOOLS,
        "expected_call": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    assert tool_call_reward(record, _call(city="Oslo"))[0] == 1.0
    assert tool_call_reward(record, _call(city="Rome"))[1]["reason"] == (
        "arguments differ from the expected call"
    )
    assert (
        tool_call_reward(record, _call("now"))[1]["reason"] == "wrong tool: expected 'get_weather'"
    )
    score, info = tool_call_reward(record, _call(city="Oslo"))
    assert info["call"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}


def test_tool_call_record_errors_raise():
    with pytest.raises(ValueError, match="no 'tools'"):
        tool_call_reward({}, _call(city="Paris"))
    bad = [{"name": "f", "parameters": {"type": "no-such-type"}}]
    with pytest.raises(ValueError, match="tool 'f' has an invalid JSON schema"):
        tool_call_reward({"tools": bad}, _call("f"))


def test_overlong_penalty_by_hand():
    # max_len 100, buffer 20: free up to 80 tokens, -1 at 100 and beyond.
    for tokens, expected in [
        (0, 0.0),
        (80, 0.0),
        (85, -0.25),
        (90, -0.5),
        (99, -0.95),
        (100, -1.0),
    ]:
        assert overlong_penalty(tokens, max_len=100, buffer=20) == pytest.approx(expected)
    assert overlong_penalty(250, max_len=100, buffer=20) == -1.0
    lengths = np.array([[10, 85], [100, 4000]])
    np.testing.assert_allclose(overlong_penalty(lengths, 100, 20), [[0.0, -0.25], [-1.0, -1.0]])
    assert overlong_penalty(100, max_len=100, buffer=100) == -1.0
    with pytest.raises(ValueError, match="0 < buffer <= max_len"):
        overlong_penalty(10, max_len=100, buffer=0)
