"""The episode endpoint: an agent written only against the `openai` client runs calculator
episodes through it, and what the server recorded trains (the trainer's log-probs are the
sampler's, observations carry no loss, the replies are the sampled tokens' text)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import BadRequestError, ConflictError, NotFoundError, OpenAI

from posttrain.data import load_tokenizer, tool_schema
from posttrain.envs import EpisodeServer, calculate
from posttrain.envs._builtin import CALCULATOR_SYSTEM
from posttrain.rewards import integer_correct
from tests.envs.conftest import assert_trained_as_sampled, load_policy

MAX_LEN, PROBLEMS, MAX_TURNS = 512, 8, 4
TOOLS = [tool_schema(calculate)]
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def split_calls(text: str) -> tuple[str, list[dict]]:
    """(the text less its well-formed `<tool_call>` blocks, their JSON); a malformed block is
    no call and stays text."""
    calls = []
    for block in _CALL.finditer(text):
        try:
            calls.append(json.loads(block.group(1)))
        except ValueError:
            continue
        text = text.replace(block.group(0), "", 1)
    return text.strip(), calls


def agent(base_url: str, question: str) -> list:
    """A tool-calling agent that knows only the OpenAI API; returns (reply message, its
    completion tokens) per turn."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": CALCULATOR_SYSTEM},
        {"role": "user", "content": question},
    ]
    replies = []
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model="my-policy", messages=messages, tools=TOOLS, temperature=0.5, max_tokens=160
        )
        message = reply.choices[0].message
        replies.append((message, reply.usage.completion_tokens))
        messages.append(message)  # the reply as returned, as OpenAI's guide does
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as e:
                result = f"Error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return replies


@pytest.fixture(scope="module")
def served(calculator_sft):
    model = load_policy(calculator_sft["workdir"])
    tokenizer = load_tokenizer(calculator_sft["tokenizer"])
    with EpisodeServer(model, tokenizer, max_len=MAX_LEN, slots=8) as server:
        yield server, model, tokenizer


def test_an_openai_agent_produces_trainable_episodes(served, calculator_sft):
    server, model, tokenizer = served
    with open(calculator_sft["eval"]) as f:
        records = [json.loads(line) for line in f][:PROBLEMS]
    ids = [server.open_episode(r) for r in records]
    with ThreadPoolExecutor(PROBLEMS) as pool:
        runs = list(pool.map(agent, map(server.base_url, ids), [r["prompt"] for r in records]))
    episodes = []
    for episode_id, record, replies in zip(ids, records, runs, strict=True):
        reward = float(integer_correct(replies[-1][0].content or "", record))
        episodes.append(server.close_episode(episode_id, reward=reward))
    # Tools were called through the endpoint: most episodes took a tool turn and answered.
    called = [ep.turns >= 2 and any(m["role"] == "tool" for m in ep.messages) for ep in episodes]
    assert sum(called) > PROBLEMS // 2, [ep.messages for ep in episodes]
    eos = set(tokenizer.eos_ids)
    for ep, record, replies in zip(episodes, records, runs, strict=True):
        assert ep.record == record and ep.finish_reason == "stop" and ep.reward is not None
        assert ep.turns == len(replies)
        assert len(ep.token_ids) == len(ep.mask) == len(ep.logprobs)
        assert sum(ep.mask) == sum(used for _, used in replies)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if not m)
        assert all(lp <= 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m)
        # Each reply is the text of the tokens the sampler drew, less the tool-call markup.
        turns, start = [], None
        for i, m in enumerate([*ep.mask, 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                turns.append(ep.token_ids[start:i])
                start = None
        assert len(turns) == len(replies)
        for sampled, (message, _) in zip(turns, replies, strict=True):
            body = sampled[:-1] if sampled[-1] in eos else sampled
            text = tokenizer.decode(body, skip_special_tokens=False)
            content, calls = split_calls(text)
            assert (message.content or "") == content
            got = [
                {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                for c in message.tool_calls or []
            ]
            assert got == calls
        # The tool results went in as observation tokens.
        observed = tokenizer.decode(
            [t for t, m in zip(ep.token_ids, ep.mask, strict=True) if not m]
        )
        for message in ep.messages:
            if message["role"] == "tool":
                assert message["content"] in observed
    assert_trained_as_sampled(model, episodes, max_len=MAX_LEN, pad_id=tokenizer.pad_id or 0)


def test_rewritten_history_unknown_and_busy_episodes_are_refused(served):
    server, _, _ = served
    episode_id = server.open_episode()
    client = OpenAI(base_url=server.base_url(episode_id), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 12 * 34?"}]
    ask = dict(model="m", tools=TOOLS, max_tokens=16, temperature=0.0)
    message = client.chat.completions.create(messages=messages, **ask).choices[0].message
    echoed = message.model_dump(exclude_none=True)
    rewritten = {**echoed, "content": (message.content or "") + " (edited)"}
    for history in (
        [*messages, rewritten, {"role": "user", "content": "go on"}],
        [
            {"role": "user", "content": "What is 12 * 35?"},
            echoed,
            {"role": "user", "content": "go on"},
        ],
        [*messages, echoed],  # nothing new
    ):
        with pytest.raises(BadRequestError, match="cannot be rewritten"):
            client.chat.completions.create(messages=history, **ask)
    with pytest.raises(BadRequestError, match="tools differ"):
        client.chat.completions.create(
            messages=[*messages, echoed, {"role": "user", "content": "go on"}], model="m"
        )
    # The refusals recorded nothing: the echoed history still extends the episode.
    again = [*messages, echoed, {"role": "user", "content": "go on"}]
    assert client.chat.completions.create(messages=again, **ask).choices
    episode = server.close_episode(episode_id)
    assert episode.turns == 2 and [m["role"] for m in episode.messages] == ["user", "assistant"] * 2
    with pytest.raises(NotFoundError, match="no open episode"):
        client.chat.completions.create(messages=messages, **ask)
    with pytest.raises(KeyError):
        server.close_episode(episode_id)
    busy = server.open_episode()
    server._episodes[busy].busy = True  # as while its request decodes
    client = OpenAI(base_url=server.base_url(busy), api_key="unused", max_retries=0)
    with pytest.raises(ConflictError, match="in progress"):
        client.chat.completions.create(messages=messages, **ask)
