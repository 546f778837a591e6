"""`posttrain serve` under abuse, through the real CLI in a subprocess on loopback: 200
concurrent requests at once (well-formed ones beside huge n, 20 MB bodies, prompts far over
the context, malformed bodies, wrong keys and clients that give up), while /health is polled.
Asserted: /health always answers, no 5xx, every well-formed request is answered or refused
with 429, every bad one gets its 4xx with OpenAI's error body, the engine and the queue are
empty afterwards, the server's resident memory after the storm is within 20% of before, and
SIGTERM with answers in flight exits within 10 s."""

import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.sampling.test_serve import NAME, _wait_for, model_dir  # noqa: F401 (a fixture)

KEY = "load-test-key"
BODY_LIMIT = 8 * 2**20  # the default --max-body-mb
QUEUE_TOKENS = 20_000  # --max-queue-tokens: n=40 x 500 tokens (20,005) can never be admitted
# --max-sequences: fewer than the storm's well-formed requests ask for at once (some get 429)
SEQUENCES = 48


class _Server:
    """`posttrain serve` on a free loopback port; `call` makes one HTTP request."""

    def __init__(self, model: str, logs):
        self.out, self.err = open(logs / "stdout", "w+"), open(logs / "stderr", "w+")
        env = {**os.environ, "POSTTRAIN_API_KEY": KEY}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "posttrain", "serve", f"--model={model}", "--port=0",
             f"--served-model-name={NAME}", f"--max-queue-tokens={QUEUE_TOKENS}",
             f"--max-sequences={SEQUENCES}"],
            stdout=self.out, stderr=self.err, env=env,
        )  # fmt: skip
        printed = lambda: (logs / "stdout").read_text()  # noqa: E731
        _wait_for(lambda: "http://" in printed(), "the URL", self.process, logs / "stderr")
        self.port = int(re.search(r"http://127.0.0.1:(\d+)", printed()).group(1))
        _wait_for(lambda: self.health() is not None, "/health", self.process, logs / "stderr")

    def connection(self, timeout=120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def call(self, path: str, body: bytes | None = None, key: str = KEY) -> tuple[int, dict]:
        """(status, JSON body) of GET (no body) or POST `body`."""
        c = self.connection()
        try:
            headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
            c.request("POST" if body is not None else "GET", path, body=body, headers=headers)
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()

    def health(self, timeout=10.0) -> float | None:
        """Seconds /health took to answer, None if it did not."""
        start = time.monotonic()
        try:
            c = self.connection(timeout)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            return None
        return time.monotonic() - start if ok else None

    def rss(self) -> int:
        """The server's resident memory in kB."""
        status = open(f"/proc/{self.process.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()
        self.err.close()


def _json(body: dict) -> bytes:
    return json.dumps({"model": NAME, **body}).encode()


def _well_formed(i: int) -> tuple[str, bytes]:
    """Request i's path and body: completions (n up to 3), chats or streams, seeded."""
    prompt = f"Count: {' '.join(str(k) for k in range(i % 7 + 1))}"
    kind = ("completions", "chat", "stream")[i % 3]
    settings = {"max_tokens": 4 + i % 21, "seed": i, "temperature": 1.0}
    if kind == "completions":
        return "/v1/completions", _json({"prompt": prompt, "n": 1 + i % 3, **settings})
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", _json({"messages": messages, **settings})
    return "/v1/completions", _json({"prompt": prompt, "stream": True, **settings})


def _send_well_formed(server: _Server, i: int) -> tuple[str, int]:
    path, body = _well_formed(i)
    streamed = b'"stream": true' in body
    c = server.connection()
    try:
        c.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}"})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    if r.status == 200:  # a whole answer: n choices; a stream: events to [DONE]
        if streamed:
            assert data.rstrip().endswith(b"data: [DONE]"), data[-200:]
        else:
            n = json.loads(body).get("n", 1)
            assert len(json.loads(data)["choices"]) == n
    return "ok", r.status


# The bad requests: (what, path, body, key, expected status, expected words in the message).
_CHAT = [{"role": "user", "content": "hi"}]
_BAD = [
    ("n=2000", "/v1/completions", _json({"prompt": "a", "n": 2000, "max_tokens": 500}), KEY,
     400, "asks for 2000 sequences"),
    ("n=200000", "/v1/chat/completions", _json({"messages": _CHAT, "n": 200000}), KEY,
     400, "asks for 200000 sequences"),
    ("n=40 x 500", "/v1/completions", _json({"prompt": "a", "n": 40, "max_tokens": 500}), KEY,
     400, "KV tokens"),
    ("6 MB prompt", "/v1/completions", _json({"prompt": "1 2 3 " * 2**20}), KEY,
     400, "characters, which cannot fit"),
    ("not JSON", "/v1/completions", b"{not json", KEY, 400, "not JSON"),
    ("deep", "/v1/chat/completions", b'{"model": "x", "m": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}", KEY, 400, "not JSON"),
    ("list body", "/v1/completions", b"[1, 2]", KEY, 400, "must be a JSON object"),
    ("content 5", "/v1/chat/completions", _json({"messages": [{"role": "user", "content": 5}]}),
     KEY, 400, "'content' must be"),
    ("content object", "/v1/chat/completions",
     _json({"messages": [{"role": "user", "content": {"a": 1}}]}), KEY, 400, "'content' must"),
    ("NaN", "/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": {json.dumps(_CHAT)}, "temperature": NaN}}'.encode(), KEY,
     400, "finite"),
    ("top_p text", "/v1/completions", _json({"prompt": "a", "top_p": "x"}), KEY, 400, "'top_p'"),
    ("no prompt", "/v1/completions", _json({}), KEY, 400, "'prompt' must be"),
    ("messages 3", "/v1/chat/completions", _json({"messages": 3}), KEY, 400, "'messages' must"),
    ("other model", "/v1/completions", json.dumps({"model": "gpt-4o", "prompt": "a"}).encode(),
     KEY, 404, "does not exist"),
    ("wrong key", "/v1/completions", _json({"prompt": "a"}), "nope", 401, "Incorrect API key"),
]  # fmt: skip


def _send_bad(server: _Server, i: int) -> tuple[str, int]:
    what, path, body, key, status, words = _BAD[i % len(_BAD)]
    got, error = server.call(path, body, key=key)
    assert (got, words in error["error"]["message"]) == (status, True), (what, got, error)
    assert error["error"]["type"] == "invalid_request_error"
    return what, got


def _send_oversized(server: _Server, i: int) -> tuple[str, int]:
    """A 20 MB body declared in Content-Length (refused before a byte of it is sent), or a
    chunked one just over the limit (refused once read past it)."""
    c = server.connection()
    try:
        c.putrequest("POST", "/v1/completions")
        c.putheader("Authorization", f"Bearer {KEY}")
        if i % 2:
            c.putheader("Content-Length", str(20 * 2**20))
            c.endheaders()
        else:
            c.putheader("Transfer-Encoding", "chunked")
            c.endheaders()
            part = b"x" * (BODY_LIMIT + 1)
            c.send(b"%x\r\n%s\r\n" % (len(part), part))  # no closing chunk: it waits
        r = c.getresponse()
        error = json.loads(r.read())
    finally:
        c.close()
    assert r.status == 413 and "this server takes at most 8388608" in error["error"]["message"]
    return "oversized", r.status


def _send_and_leave(server: _Server, i: int) -> tuple[str, int]:
    """A 400-token answer, whole or streamed, abandoned after 0.3 s or the first event."""
    streamed = bool(i % 2)
    body = _json({"prompt": "Count: 1 2 3", "max_tokens": 400, "temperature": 0,
                  "stream": streamed})  # fmt: skip
    c = server.connection()
    c.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
    if streamed:
        r = c.getresponse()
        if r.status == 200:
            r.fp.readline()  # the first event
    else:
        time.sleep(0.3)
    c.sock.close()
    c.close()
    return "left", 0


# The storm: 200 requests, started together.
_STORM = (
    [(_send_well_formed, i) for i in range(120)]
    + [(_send_bad, i) for i in range(50)]
    + [(_send_oversized, i) for i in range(10)]
    + [(_send_and_leave, i) for i in range(20)]
)


def _storm(server: _Server) -> list[tuple[str, int]]:
    with concurrent.futures.ThreadPoolExecutor(len(_STORM)) as pool:
        futures = [pool.submit(send, server, i) for send, i in _STORM]
        return [f.result() for f in futures]


def _settled(server: _Server) -> bool:
    status, stats = server.call("/v1/stats")
    queue = stats["queue"]
    return (
        status == 200
        and stats["requests"] == stats["blocks_in_use"] == 0
        and not any(queue.values())
    )


@pytest.fixture
def server(model_dir, tmp_path):  # noqa: F811
    s = _Server(model_dir, tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_two_hundred_hostile_requests_leave_the_server_answering(server):
    # First until a storm compiles nothing new: the engine compiles a program per prefill
    # (new prompts, prompt length) and decode (blocks attended) bucket it meets, which the
    # storm's timing picks; each costs resident memory (measured: +150 to +200 MB over the
    # first storm, 10 to 40 MB per new program after), bounded by the buckets' number.
    compiled = None
    for _ in range(6):
        _storm(server)
        _wait_for(lambda: _settled(server), "the warm-up's end")
        if compiled == (compiled := server.call("/v1/stats")[1]["compilations"]):
            break
    before = server.rss()
    worst, stop = [0.0], threading.Event()

    def poll():
        while not stop.is_set():
            took = server.health()
            worst[0] = max(worst[0], float("inf") if took is None else took)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    started = time.monotonic()
    try:
        outcomes = _storm(server)
    finally:
        stop.set()
        poller.join()
    took = time.monotonic() - started
    _wait_for(lambda: _settled(server), "the storm's end")
    after = server.rss()
    compiled = server.call("/v1/stats")[1]["compilations"] - compiled
    statuses = [status for _, status in outcomes]
    well_formed = statuses[:120]
    answered, busy = well_formed.count(200), well_formed.count(429)
    print(f"storm: {took:.1f} s, /health worst {worst[0]:.3f} s, RSS {before} -> {after} kB "
          f"({compiled} new programs), well-formed: {answered} answered, {busy} 429")  # fmt: skip
    assert worst[0] < 10.0  # (generous: a loaded CI machine; see the closing note's numbers)
    assert not [s for s in statuses if s >= 500]
    assert set(well_formed) <= {200, 429} and answered >= 30
    assert abs(after - before) <= 0.2 * before, (before, after)

    # SIGTERM with answers in flight: they get --drain-s (5 s), then the server exits.
    answers = []

    def stay(streamed: bool):
        body = _json({"prompt": "Count: 1", "max_tokens": 400, "stream": streamed})
        try:
            answers.append(server.call("/v1/completions", body)[0])
        except (OSError, http.client.HTTPException, json.JSONDecodeError):
            answers.append("cut")

    waiting = [threading.Thread(target=stay, args=(i % 2 == 0,)) for i in range(4)]
    for t in waiting:
        t.start()
    _wait_for(lambda: server.call("/v1/stats")[1]["requests"] > 0, "answers in flight")
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=30)
    exited = time.monotonic() - start
    print(f"SIGTERM: exited in {exited:.2f} s with {server.process.returncode}")
    for t in waiting:
        t.join()
    # (uvicorn ends by re-raising the signal it caught: the status a supervisor expects)
    assert exited < 10.0 and server.process.returncode in (0, -signal.SIGTERM)
    assert len(answers) == 4  # each answered (200) or cut at the drain's end, none left hanging
