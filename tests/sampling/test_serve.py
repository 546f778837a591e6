"""`posttrain serve` driven by the official `openai` client: answers equal `generate`'s, alone
and decoded together in the engine; engine failures are HTTP 500s; `Engine.cancel`."""

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import jax
import openai
import pytest
import uvicorn

from posttrain import cli
from posttrain.demo import ASSETS_DIR
from posttrain.models import MTPModule, Transformer, get_preset, to_hf
from posttrain.sampling import (
    Completion,
    Engine,
    EngineConfig,
    PromptLookup,
    Request,
    ServeConfig,
    generate,
    generate_speculative,
)
from posttrain.sampling._backend import PRESETS, Piece, _Backend
from posttrain.sampling._serve import create_app
from posttrain.sampling._serve_reply import _tool_calls
from posttrain.train import load_model_and_tokenizer

NAME = "tiny-test"
PROMPTS = ["What is 3 + 4?", "Count: 1 2 3"]
CHAT = [{"role": "user", "content": "What is 3 + 4?"}]
LONG, SEED = 40, 7  # the concurrent sampled requests: tokens, and the first prompt's seed


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


def _get(url: str, path: str):
    with urllib.request.urlopen(url.rstrip("/").removesuffix("/v1") + path, timeout=5) as r:
        return json.load(r)


def _post_raw(url: str, path: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a POST whose bytes a client library would not send (NaN, ...)."""
    request = urllib.request.Request(
        url.rstrip("/") + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _healthy(url: str) -> bool:
    try:
        return _get(url, "/health") == {"status": "ok"}
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
def loaded(model_dir):
    """The model and tokenizer as the server loads them, in this process."""
    return load_model_and_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference(loaded):
    """The tokenizer, and `generate`'s greedy answers to PROMPTS and to CHAT's templated prompt
    (one batch) on the model as the server loads it, computed in this process."""
    model, tokenizer = loaded
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    *plain, [chat_answer] = generate(model, tokenizer, [*PROMPTS, chat], max_new_tokens=8)
    return tokenizer, [s[0] for s in plain], chat_answer


@pytest.fixture(scope="module")
def sampled_reference(loaded):
    """Two LONG-token samples of PROMPTS and CHAT's prompt, seeds SEED + i, as the latency
    preset draws them: speculative decoding with prompt lookup (its own draws, not plain
    decoding's; test_speculative.py shows they have the model's distribution)."""
    model, tokenizer = loaded
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    drafter = PromptLookup(k=PRESETS["latency"].speculative)
    return generate_speculative(model, tokenizer, [*PROMPTS, chat], max_new_tokens=LONG,
                                temperature=1.0, n=2, seeds=[SEED, SEED + 1, SEED + 2],
                                drafter=drafter)  # fmt: skip


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory, request):
    """`posttrain serve` in a subprocess through the real CLI, on a free port."""
    logs = tmp_path_factory.mktemp("serve_logs")
    out, err = open(logs / "stdout", "w+"), open(logs / "stderr", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", f"--model={model_dir}", "--port=0",
         f"--served-model-name={NAME}", "--preset=latency"],
        stdout=out, stderr=err,
    )  # fmt: skip
    try:
        for name in ("reference", "sampled_reference"):  # computed while the server starts
            request.getfixturevalue(name)
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


def test_concurrent_requests_decode_together_and_each_equals_generate(
    client, reference, sampled_reference
):
    """Four clients at once (greedy; two prompts with two seeded samples each; a chat's seeded
    samples, whole and streamed): each gets its own `generate` answer, and they shared the
    engine's device calls (9 rows on 8: one waits for a free row)."""
    _, greedy, _ = reference
    url = str(client.base_url)
    before = _get(url, "/v1/stats")
    start = threading.Barrier(4)
    sampled = dict(model=NAME, max_tokens=LONG, temperature=1.0)

    def complete(**settings):
        start.wait()
        return [c.text for c in client.completions.create(**settings).choices]

    def chat(**settings):
        start.wait()
        if not settings.get("stream"):
            return [c.message.content for c in client.chat.completions.create(**settings).choices]
        chunks = client.chat.completions.create(**settings)
        return ["".join(c.choices[0].delta.content or "" for c in chunks)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(complete, model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0),
            pool.submit(complete, prompt=PROMPTS, n=2, seed=SEED, **sampled),
            pool.submit(chat, messages=CHAT, n=2, seed=SEED + 2, **sampled),
            pool.submit(chat, messages=CHAT, seed=SEED + 2, stream=True, **sampled),
        ]
        answers = [f.result() for f in futures]
    texts = [[c.text for c in samples] for samples in sampled_reference]
    assert answers == [[c.text for c in greedy], texts[0] + texts[1], texts[2], texts[2][:1]]
    assert texts[0][0] != texts[0][1]
    # Alone, a request needs one device call per `chunk` tokens of its longest sample.
    chunk = before["chunk"]
    calls = [-(-max(len(c.token_ids) for c in samples) // chunk) for samples in
             ([*greedy], [*sampled_reference[0], *sampled_reference[1]], sampled_reference[2],
              sampled_reference[2][:1])]  # fmt: skip
    after = _get(url, "/v1/stats")
    assert after["decode_calls"] - before["decode_calls"] < sum(calls)
    assert after["requests"] == after["blocks_in_use"] == 0  # every row and block given back


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
    for value in ("NaN", "Infinity", "-Infinity"):  # JSON's extensions Python reads
        body = f'{{"model": "{NAME}", "messages": {json.dumps(CHAT)}, "temperature": {value}}}'
        status, error = _post_raw(str(client.base_url), "/chat/completions", body.encode())
        assert status == 400, (value, error)
        assert "temperature must be a finite number >= 0" in error["error"]["message"]
    for content, message in [
        (5, "'content' must be a string, a list of text parts or null, got 5"),
        ({"a": 1}, "'content' must be a string"),
        ([{"type": "text", "text": 7}], "only text content parts are supported"),
    ]:
        body = {"model": NAME, "messages": [{"role": "user", "content": content}]}
        status, error = _post_raw(
            str(client.base_url), "/chat/completions", json.dumps(body).encode()
        )
        assert status == 400 and message in error["error"]["message"], error
    # A body declared at 9 MiB (over the default 8) is refused from its headers, before it is
    # sent: the client reads the answer without sending a byte of it.
    parsed = urllib.parse.urlsplit(str(client.base_url))
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    connection.putrequest("POST", parsed.path.rstrip("/") + "/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(9 * 2**20))
    connection.endheaders()
    answer = connection.getresponse()
    error = json.load(answer)
    connection.close()
    assert (
        answer.status == 413
        and "is 9437184 bytes; this server takes at most 8388608" in (error["error"]["message"])
    )
    deep = b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, error = _post_raw(str(client.base_url), "/chat/completions", deep)
    assert (status, error["error"]["message"]) == (400, "the request body is not JSON")


def test_health_answers_while_a_long_prompt_is_refused(client):
    """A 6 MiB prompt (under the body limit, far over the context): /health keeps answering
    while it is read and refused as too long (by its length in characters, untokenized)."""
    url = str(client.base_url)
    body = json.dumps({"model": NAME, "prompt": "1 2 3 " * 2**20}).encode()
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            zip(("status", "error"), _post_raw(url, "/completions", body), strict=True)
        )
    )
    worker.start()
    worst = 0.0
    while worker.is_alive():
        start = time.monotonic()
        assert _healthy(url)
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    message = result["error"]["error"]["message"]
    assert result["status"] == 400 and "6291456 characters, which cannot fit" in message
    assert worst < 5.0, worst  # (generous: a loaded CI machine; measured below 0.1 s here)


def test_a_bad_model_directory_is_one_user_error(model_dir, tmp_path, capsys):
    assert cli.main(["serve", f"--model={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "neither an HF model directory" in err and "Traceback" not in err
    assert cli.main(["serve", f"--model={model_dir}", "--mtp"]) == 2  # a Qwen3: no MTP layer
    err = capsys.readouterr().err
    assert "no multi-token-prediction layers" in err and "Traceback" not in err


def test_an_mtp_module_drafts_for_the_latency_preset(loaded):
    model, tokenizer = loaded
    module = MTPModule.init(model.config)
    backend = _Backend(model, tokenizer, ServeConfig.from_preset("latency"), mtp=module)
    stats = backend.stats()
    backend.close()
    assert stats["drafter"] == "MTP" and backend.engine.drafter.module is module
    assert backend.engine.drafter.k == PRESETS["latency"].speculative


def test_tool_call_blocks_become_tool_calls():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    text, calls = _tool_calls(f"Adding.{call}")
    assert text == "Adding."
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert _tool_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_set_the_engine(loaded, preset):
    """Each preset's rows, chunk and drafts; the default pool holds max_seq_len tokens per row."""
    backend = _Backend(*loaded, ServeConfig.from_preset(preset))
    stats = backend.stats()
    backend.close()
    slots, chunk = PRESETS[preset].slots, PRESETS[preset].chunk
    assert (stats["slots"], stats["chunk"]) == (slots, chunk) and stats["requests"] == 0
    assert stats["speculative"] == PRESETS[preset].speculative
    assert stats["drafter"] == ("PromptLookup" if stats["speculative"] else None)
    # The scratch block, and 16-token blocks for 512 tokens plus a speculative round's drafts.
    ahead = PRESETS[preset].speculative
    assert stats["num_blocks"] == 1 + slots * -(-(512 + ahead) // 16)


@pytest.fixture
def in_process(loaded):
    """A server in this process over a real `_Backend` (2 rows, 2-step chunks), and its client."""
    model, tokenizer = loaded
    config = ServeConfig(model_name=NAME, engine=EngineConfig(slots=2, chunk=2, prefill_bucket=16))
    backend = _Backend(model, tokenizer, config)
    try:
        with _running(create_app(backend, config)) as client:
            yield backend, client
    finally:
        backend.close()


def test_a_request_sharing_a_long_prefix_prefills_only_its_new_blocks(loaded):
    """With the prefix cache (`EngineConfig.prefix_cache`, on in the serve presets) a second
    request whose prompt starts like the first's (a long system text) finds the first's full
    blocks: it prefills only the tokens past the blocks they share (counted), and answers what
    a server without the cache answers."""
    model, tokenizer = loaded
    system = "You are a careful assistant who answers briefly and checks every step. " * 3
    prompts = [system + "What is 2 + 2?", system + "Name a colour that is not red."]
    answers, stats = {}, {}
    for cache in (True, False):
        engine = EngineConfig(slots=2, chunk=2, prefill_bucket=16, prefix_cache=cache)
        config = ServeConfig(model_name=NAME, engine=engine)
        backend = _Backend(model, tokenizer, config)
        try:
            with _running(create_app(backend, config)) as client:
                settings = dict(model=NAME, max_tokens=8, temperature=0)
                client.completions.create(prompt=prompts[0], **settings)
                before = backend.stats()
                reply = client.completions.create(prompt=prompts[1], **settings)
                after = backend.stats()
        finally:
            backend.close()
        answers[cache] = reply.choices[0].text
        stats[cache] = {k: after[k] - before[k] for k in ("prompt_tokens", "prefill_tokens",
                                                          "cached_tokens")}  # fmt: skip
    first, second = (tokenizer.encode(p) for p in prompts)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    shared = 16 * min(common // 16, len(first) // 16)  # the full blocks both prompts begin with
    assert shared >= 32
    assert stats[True] == {"prompt_tokens": len(second), "prefill_tokens": len(second) - shared,
                           "cached_tokens": shared}  # fmt: skip
    assert stats[False]["prefill_tokens"] == len(second)
    assert answers[True] == answers[False]


def test_an_engine_failure_is_a_500_and_the_next_request_runs(in_process, reference):
    """A failed engine step fails the requests in the engine (HTTP 500, or an error event in a
    started stream); the server starts a fresh engine and answers the next request."""
    backend, client = in_process
    _, expected, _ = reference

    def fail_after(good: int):
        """`backend.engine.step`, failing after `good` calls (on this engine: a failed engine
        is replaced)."""
        step, made = backend.engine.step, []

        def steps():
            made.append(1)
            if len(made) > good:
                raise RuntimeError("device lost")
            return step()

        backend.engine.step = steps

    fail_after(0)
    with pytest.raises(openai.InternalServerError, match="RuntimeError: device lost"):
        client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    fail_after(0)
    with pytest.raises(openai.InternalServerError, match="device lost"):
        client.completions.create(model=NAME, prompt="x", max_tokens=8, stream=True)
    fail_after(1)
    settings = dict(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    stream, streamed = client.completions.create(**settings, stream=True), []
    with pytest.raises(openai.APIError, match="device lost"):
        for chunk in stream:
            streamed.append(chunk.choices[0].text)
    assert streamed and expected[0].text.startswith("".join(streamed))  # sent before it failed
    assert client.completions.create(**settings).choices[0].text == expected[0].text
    stats = backend.stats()
    assert stats["decode_calls"] == 1 + -(-len(expected[0].token_ids) // 2)  # failures: none
    assert stats["blocks_in_use"] == stats["requests"] == 0


def test_a_client_that_goes_away_frees_its_row(in_process):
    backend, client = in_process
    # Greedy, this model answers PROMPTS[0] with 400 tokens and no EOS.
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=400,
                                       temperature=0, stream=True)  # fmt: skip
    assert next(iter(stream)).choices[0].text
    stream.close()
    _wait_for(lambda: backend.stats()["requests"] == 0, "the request's cancellation")
    stats = backend.stats()
    assert stats["blocks_in_use"] == 0 and stats["generated_tokens"] < 400


def test_cancel_frees_rows_and_blocks_and_leaves_the_others_alone(loaded):
    """Cancelling a running request, one sample of another and a queued one: their rows and
    blocks go back, the rest decode as they would have alone."""
    model, _ = loaded
    engine = Engine(model, EngineConfig(slots=2, chunk=2, prefill_bucket=16), eos_ids=())
    key = jax.random.key(0)
    gone = engine.submit(Request([1, 2, 3], 8, key))
    engine.step()
    pair, queued = engine.submit(Request([4, 5], 8, key, n=2)), engine.submit(Request([6], 8, key))
    engine.step()  # `pair`'s first sample takes the other row; the rest wait
    assert engine.cancel(gone) and len(gone.tokens[0]) == 4
    engine.step()  # `pair`'s second sample takes the freed row
    with pytest.raises(ValueError, match="not running"):
        engine.cancel(Request([1], 4, key, n=2), 1)
    assert not engine.cancel(pair, 1) and engine.cancel(queued)
    engine.run()
    assert len(pair.tokens[0]) == 8 and len(pair.tokens[1]) == 2 and queued.tokens == [[]]
    assert engine.idle and engine.blocks_in_use == 0
    alone = Engine(model, EngineConfig(slots=2, chunk=2, prefill_bucket=16), eos_ids=())
    alone.submit(again := Request([4, 5], 8, key))
    alone.run()
    assert pair.tokens[0] == again.tokens[0] and pair.tokens[1] == again.tokens[0][:2]


class _ScriptedBackend:
    """A backend that answers every prompt with `text`; `complete` waits for `go` once set."""

    max_seq_len = kv_tokens = 4096

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

    def stats(self):
        return {}

    async def complete(self, prompts, settings):
        self.entered.set()
        if self.go is not None:
            await asyncio.to_thread(self.go.wait)
        done = Completion(self.text, (1,) * 3, (0.0,) * 3, "stop")
        return [[done] * settings.n for _ in prompts]

    async def stream(self, prompt, settings):
        for i in range(0, len(self.text), 4):  # pieces that split the tags
            yield Piece(self.text[i : i + 4], i // 4 + 1, None)
        yield Piece("", len(self.text) // 4 + 1, "stop")


@contextlib.contextmanager
def _running(app):
    """`app` served by uvicorn in a thread on a free port; yields its openai client."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    try:
        _wait_for(lambda: _healthy(url), "/health")
        yield openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture
def scripted():
    """An in-process server over a `_ScriptedBackend`, at most one request at a time."""
    backend = _ScriptedBackend('Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    with _running(create_app(backend, ServeConfig(model_name=NAME, max_sequences=1))) as client:
        yield backend, client


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


def _metrics(url: str) -> dict[str, float]:
    """The samples of `GET /metrics`, parsed by prometheus-client: name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    base = url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def _post_and_leave(url: str, body: dict, wait) -> None:
    """POSTs `body` (not streamed) over a raw connection, waits for `wait()`, then closes the
    connection without reading the answer: a client that gave up."""
    parsed = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        sock.sendall(
            f"POST {parsed.path.rstrip('/')}/completions HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        _wait_for(wait, "the request in the engine")


def test_a_client_that_leaves_a_whole_request_cancels_it(in_process):
    """Not streamed: the handler notices the closed connection while the engine decodes,
    cancels the request (its row and blocks back at once) and counts it as 499."""
    backend, client = in_process
    url = str(client.base_url)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0}
    _post_and_leave(url, body, lambda: backend.stats()["generated_tokens"] > 0)
    _wait_for(lambda: backend.stats()["requests"] == 0, "the request's cancellation")
    stats = backend.stats()
    assert stats["blocks_in_use"] == 0 and stats["generated_tokens"] < 400
    _wait_for(lambda: backend.stats()["generated_tokens"] == stats["generated_tokens"], "idle")
    assert _metrics(url)['posttrain_requests_total{path="/v1/completions",status="499"}'] == 1


def test_metrics_count_requests_tokens_and_blocks(in_process, reference):
    backend, client = in_process
    url = str(client.base_url)
    _, expected, _ = reference
    answer = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in answer.choices] == [e.text for e in expected]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="x", n=65)  # over --max-request-samples
    assert _healthy(url)
    m, stats = _metrics(url), backend.stats()
    assert m['posttrain_requests_total{path="/v1/completions",status="200"}'] == 1
    assert m['posttrain_requests_total{path="/v1/completions",status="400"}'] == 1
    assert m['posttrain_requests_total{path="/health",status="200"}'] >= 1
    generated = sum(len(e.token_ids) for e in expected)
    assert m["posttrain_generated_tokens_total"] == stats["generated_tokens"] == generated
    assert 0 < m["posttrain_tokens_per_second"] <= generated / 1e-3
    assert m["posttrain_kv_blocks"] == stats["num_blocks"] > 1
    assert m["posttrain_kv_blocks_in_use"] == m["posttrain_queue_sequences"] == 0
    assert m["posttrain_queue_requests"] == m["posttrain_queue_tokens"] == 0
    assert m["posttrain_compilations_total"] == stats["compilations"]  # (this process's)


@pytest.fixture
def limited():
    """A scripted server taking 4 sequences a request, 6 and 3000 KV tokens at once."""
    backend = _ScriptedBackend("ok")
    config = ServeConfig(model_name=NAME, max_request_samples=4, max_sequences=6,
                         max_queue_tokens=3000)  # fmt: skip
    with _running(create_app(backend, config)) as client:
        yield backend, client


def test_admission_counts_sequences_and_tokens_not_requests(limited):
    backend, client = limited
    url = str(client.base_url)
    ask = lambda **kw: client.completions.create(model=NAME, prompt="ab", **kw)  # noqa: E731
    with pytest.raises(openai.BadRequestError, match=r"asks for 6 sequences \(n x prompts\)"):
        client.completions.create(model=NAME, prompt=["a", "b"], n=3)  # 6 > 4 a request
    # 2 + 2 x 1600 KV tokens: more than the whole queue holds, so never admitted: 400.
    with pytest.raises(openai.BadRequestError, match="needs 3202 KV tokens"):
        ask(n=2, max_tokens=1600)
    backend.go = threading.Event()
    first = threading.Thread(target=lambda: ask(n=4, max_tokens=10))
    first.start()
    backend.entered.wait()
    try:
        assert _get(url, "/v1/stats")["queue"] == {"requests": 1, "sequences": 4, "tokens": 42}
        with pytest.raises(openai.RateLimitError, match="4 of 6 sequences, 42 of 3000 KV"):
            ask(n=3, max_tokens=10)  # 7 sequences: over 6
        with pytest.raises(openai.RateLimitError, match="busy"):
            ask(n=1, max_tokens=2960)  # 42 + 2962 tokens: over 3000
        second = threading.Thread(target=lambda: ask(n=2, max_tokens=10))  # fits: admitted
        second.start()
        _wait_for(lambda: _get(url, "/v1/stats")["queue"]["sequences"] == 6, "admission")
    finally:
        backend.go.set()
        first.join()
    second.join()
    assert _get(url, "/v1/stats")["queue"] == {"requests": 0, "sequences": 0, "tokens": 0}


def test_an_api_key_guards_v1_and_health_stays_open():
    backend = _ScriptedBackend("ok")
    config = ServeConfig(model_name=NAME, api_key="s3cret")
    assert "s3cret" not in repr(config)
    with _running(create_app(backend, config)) as client:
        url = str(client.base_url)
        for key in ("x", "s3cret-and-more", ""):
            with pytest.raises(openai.AuthenticationError, match="Incorrect API key") as e:
                client.with_options(api_key=key).models.list()
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        status, error = _post_raw(url, "/completions", b'{"model": "tiny-test", "prompt": "a"}')
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
        keyed = client.with_options(api_key="s3cret")
        assert keyed.completions.create(model=NAME, prompt="a").choices[0].text == "ok"
        assert _healthy(url)  # /health (and /metrics) need no key: probes and scrapers


def test_an_unknown_path_is_an_openai_error(scripted):
    _, client = scripted
    status, error = _post_raw(str(client.base_url), "/embeddings", b"{}")
    assert status == 404 and error["error"]["message"] == "Not Found"


def test_serving_beyond_loopback_without_a_key_warns_before_the_model_loads(tmp_path, capsys):
    assert cli.main(["serve", f"--model={tmp_path}", "--host=0.0.0.0", "--port=0"]) == 2
    err = capsys.readouterr().err
    assert "--host=0.0.0.0 serves beyond this machine and no API key is set" in err
    assert err.index("warning") < err.index("neither an HF model")  # then the model refused
    assert cli.main(["serve", f"--model={tmp_path}", "--port=0"]) == 2
    assert "warning" not in capsys.readouterr().err  # loopback: no warning
