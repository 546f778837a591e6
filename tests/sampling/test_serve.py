"""`posttrain serve` driven by the official `openai` client: answers equal `generate`'s."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import uvicorn

from posttrain import cli
from posttrain.demo import ASSETS_DIR
from posttrain.models import Transformer, get_preset, to_hf
from posttrain.sampling import Completion, ServeConfig, generate
from posttrain.sampling._serve import Piece, _tool_calls, create_app
from posttrain.train import load_model_and_tokenizer

NAME = "tiny-test"
PROMPTS = ["What is 3 + 4?", "Count: 1 2 3"]
CHAT = [{"role": "user", "content": "What is 3 + 4?"}]


def _wait_for(condition, what: str, process=None, log=None):
    """Polls `condition` until it holds; fails if `process` exits first (with the end of its
    `log`), or after two minutes for a stuck server."""
    for _ in range(1200):
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the server exited ({process.returncode}):\n{log.read_text()}")
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(f"{what}: gave up waiting")


def _healthy(url: str) -> bool:
    try:
        root = url.rstrip("/").removesuffix("/v1")
        with urllib.request.urlopen(root + "/health", timeout=5) as r:
            return json.load(r) == {"status": "ok"}
    except OSError:
        return False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "model"
    to_hf(Transformer.init(get_preset("tiny", attention="xla"), rng=2), str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ASSETS_DIR, "tokenizer", name), path / name)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The tokenizer, and `generate`'s greedy answers to PROMPTS and to CHAT's templated prompt
    (one batch) on the model as the server loads it, computed in this process."""
    model, tokenizer = load_model_and_tokenizer(model_dir)
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    *plain, [chat_answer] = generate(model, tokenizer, [*PROMPTS, chat], max_new_tokens=8)
    return tokenizer, [s[0] for s in plain], chat_answer


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory, request):
    """`posttrain serve` in a subprocess through the real CLI, on a free port."""
    logs = tmp_path_factory.mktemp("serve_logs")
    out, err = open(logs / "stdout", "w+"), open(logs / "stderr", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", f"--model={model_dir}", "--port=0",
         f"--served-model-name={NAME}"],
        stdout=out, stderr=err,
    )  # fmt: skip
    try:
        request.getfixturevalue("reference")  # computed while the server starts
        printed = lambda: (logs / "stdout").read_text()  # noqa: E731
        _wait_for(lambda: "http://" in printed(), "the URL", process, logs / "stderr")
        url = re.search(r"http://\S+", printed()).group(0)
        _wait_for(lambda: _healthy(url), "/health", process, logs / "stderr")
        yield openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    finally:
        process.terminate()
        process.wait(timeout=60)
        out.close()
        err.close()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == [NAME]


def test_completions_equal_generate(client, reference):
    tokenizer, expected, _ = reference
    response = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in response.choices] == [c.text for c in expected]
    assert all(c.text for c in expected)  # the prompts make the random model say something
    assert [c.finish_reason for c in response.choices] == [c.finish_reason for c in expected]
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in expected)
    # Token ids are a prompt too.
    ids = client.completions.create(
        model=NAME, prompt=tokenizer.encode(PROMPTS[0]), max_tokens=8, temperature=0
    )
    assert ids.choices[0].text == expected[0].text
    # Sampled answers repeat with the same seed.
    sampled = [
        client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, seed=5)
        for _ in range(2)
    ]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]


def test_chat_completion_equals_generate_on_the_templated_prompt(client, reference):
    tokenizer, _, expected = reference
    response = client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=8, temperature=0
    )
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(prompt)


def test_streamed_chunks_concatenate_to_the_whole_answer(client, reference):
    tokenizer, _, expected = reference
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)  # one compilation
    chunks = list(
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-2].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # A stop string cuts both at the same place; the stream holds back what may begin one.
    stop = next(expected.text[i : i + 2] for i in range(1, 7) if expected.text[i : i + 2].isalnum())
    settings = dict(model=NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "zz"])
    whole = client.completions.create(**settings).choices[0]
    streamed = list(client.completions.create(**settings, stream=True))
    assert whole.finish_reason == streamed[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert whole.text == expected.text[: expected.text.index(stop)]

    settings = dict(model=NAME, messages=CHAT, max_tokens=8, temperature=1.0, seed=11)
    whole = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content  # a sampled stream draws the same keys
    assert streamed != expected.text


def test_refused_requests_are_openai_errors(client, reference):
    long = "1 2 3 " * 200
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=long, max_tokens=8)
    assert e.value.status_code == 400
    message = e.value.body["message"]
    size = len(reference[0].encode(long))
    assert f"maximum context length is 512 tokens, but the prompt has {size} tokens" in message
    assert e.value.body["type"] == "invalid_request_error"
    bad = {"temperature": -1, "top_p": 0, "n": 0, "max_tokens": 0}
    for key, value in bad.items():
        with pytest.raises(openai.BadRequestError, match=f"{key}.*{value}"):
            client.chat.completions.create(**{"model": NAME, "messages": CHAT, key: value})
    with pytest.raises(openai.BadRequestError, match="token id 512 is outside the vocabulary"):
        client.completions.create(model=NAME, prompt=[5, 512])
    with pytest.raises(openai.BadRequestError, match="one prompt and n=1"):
        client.completions.create(model=NAME, prompt=PROMPTS, stream=True)
    with pytest.raises(openai.BadRequestError, match="'logprobs' is not supported"):
        client.completions.create(model=NAME, prompt="hi", logprobs=2)
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_a_bad_model_directory_is_one_user_error(tmp_path, capsys):
    assert cli.main(["serve", f"--model={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "neither an HF model directory" in err and "Traceback" not in err


def test_tool_call_blocks_become_tool_calls():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text, calls = _tool_calls(f"Adding.{call}")
    assert text == "Adding."
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert _tool_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )


class _ScriptedBackend:
    """A backend that answers every prompt with `text`; `complete` waits for `go` once set."""

    max_seq_len = 4096

    class tokenizer:  # noqa: N801
        adds_bos, bos_id, vocab_size = False, None, 128

        @staticmethod
        def encode(text):
            return [ord(c) for c in text]

        @staticmethod
        def apply_chat_template(messages, *, add_generation_prompt, tools):
            return [ord(c) for c in json.dumps([messages, tools])]

    def __init__(self, text):
        self.text, self.entered, self.go = text, threading.Event(), None

    def complete(self, prompts, settings):
        self.entered.set()
        if self.go is not None:
            self.go.wait()
        done = Completion(self.text, (1,) * 3, (0.0,) * 3, "stop")
        return [[done] * settings.n for _ in prompts]

    def stream(self, prompt, settings):
        for i in range(0, len(self.text), 4):  # pieces that split the tags
            yield Piece(self.text[i : i + 4], i // 4 + 1, None)
        yield Piece("", len(self.text) // 4 + 1, "stop")


@pytest.fixture
def scripted():
    """An in-process server over a `_ScriptedBackend`, at most one request at a time."""
    backend = _ScriptedBackend('Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    config = ServeConfig(model_name=NAME, max_requests=1)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, config), log_level="warning"))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    _wait_for(lambda: _healthy(url), "/health")
    yield backend, openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    server.should_exit = True
    thread.join()


def test_tool_calls_whole_and_streamed(scripted):
    backend, client = scripted
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    answer = client.chat.completions.create(model=NAME, messages=CHAT, tools=tools)
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1})

    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, tools=tools,
                                                 stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Sure."
    [streamed] = [t for d in deltas for t in d.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == ("add", '{"a": 1}')
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the same text is plain content.
    plain = client.chat.completions.create(model=NAME, messages=CHAT)
    assert plain.choices[0].message.content == backend.text
    assert plain.choices[0].message.tool_calls is None


def test_a_request_beyond_the_limit_gets_429_while_the_event_loop_stays_free(scripted):
    backend, client = scripted
    backend.go = threading.Event()
    first = threading.Thread(
        target=lambda: client.completions.create(model=NAME, prompt="a", max_tokens=2)
    )
    first.start()
    backend.entered.wait()
    try:
        with pytest.raises(openai.RateLimitError, match="busy"):
            client.completions.create(model=NAME, prompt="b", max_tokens=2)
        assert _healthy(str(client.base_url))  # answered while the first request computes
    finally:
        backend.go.set()
        first.join()
    assert client.completions.create(model=NAME, prompt="c", max_tokens=2).choices[0].text
