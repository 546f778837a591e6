"""Bring your own agent: an OpenAI-compatible endpoint that records each episode for training.

Agent code that speaks OpenAI's chat API with tools runs unmodified against
`EpisodeServer.base_url(episode_id)`: each `POST .../v1/chat/completions` is one model turn,
sampled by `posttrain serve`'s backend (one thread owning one `Engine`: every open episode's
turns decode together). Each episode is kept token in / token out, as in `run_episodes`:

- the first request's messages and tools are the prompt (`Turns.prompt`);
- each reply's sampled ids are appended with the raw model's log-probs (loss mask 1), and its
  message (content and tool calls, parsed in the template's tool-call format) is recorded;
- a later request must repeat the recorded conversation (the agent echoes the replies back;
  compared by role, content, tool-call ids, names and arguments, JSON strings or objects) and
  append to it: the new messages become observation ids (`Turns.observation`, loss mask 0),
  and the episode's ids so far are the next turn's prompt. A request that rewrites the history
  is refused (HTTP 400), since the recorded tokens would no longer be the conversation.

`close_episode` returns the `Episode` (as `run_episodes` does), ready for `rl.rollout_batch`.
Only chat completions, answered whole (no streaming), n=1, any model name; one request at a
time per episode (a concurrent second one gets HTTP 409).
"""

import dataclasses
import json
import socket
import threading
import time
import uuid

import jinja2
import numpy as np

from posttrain.data import ParsedTurn, Turns, parse_tool_calls, tool_format_for
from posttrain.envs._episode import Episode
from posttrain.models import Transformer
from posttrain.sampling import (
    APIError,
    Completion,
    EngineConfig,
    ServeBackend,
    ServeConfig,
    api_app,
    request_field,
    request_settings,
    request_tools,
)

MODEL_NAME = "posttrain-episodes"  # the model the answers name (requests may name any)


@dataclasses.dataclass
class _Live:
    """An open episode: what was recorded, and whether a request is in progress."""

    episode: Episode
    serial: int  # the n-th episode this server opened (its default sampling seeds)
    turns: Turns | None = None  # made from the first request's tools
    tools: str = ""  # the first request's tools, as canonical JSON
    busy: bool = False
    ended: bool = True  # the last reply ended with an end-of-turn token
    cut: bool = False  # the last reply reached max_tokens


@dataclasses.dataclass(frozen=True)
class _Turn:
    """A checked request: what it adds to the episode before the model's reply."""

    messages: list[dict]  # the new messages (every message on the first request)
    ids: list[int]  # their ids: the prompt, or the observation
    turns: Turns
    tools: str


class EpisodeServer:
    """An in-process HTTP server speaking OpenAI chat completions, one URL per episode.

    Args:
      model: the policy to sample from (its weights now; log-probs are this model's).
      tokenizer: its `posttrain.data.Tokenizer`; its chat template renders messages and tools.
      max_len: the longest episode in tokens (prompt, replies and observations).
      slots: replies decoded together (engine rows); more requests wait for a free row.
      tool_format: how tool calls are parsed from replies ("hermes", "llama3_json", "mistral",
        ...); "auto" guesses from the chat template.
      seed: the base of the sampling seeds of requests that send none (per episode and turn).
      host, port: where to listen; port 0 picks a free one.

    Usable as a context manager (`stop` on exit).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        *,
        max_len: int,
        slots: int = 16,
        tool_format: str = "auto",
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        import uvicorn

        if not 0 < max_len <= model.config.max_seq_len:
            raise ValueError(f"max_len={max_len} must be in 1..{model.config.max_seq_len}")
        if tool_format == "auto":
            tool_format = tool_format_for(tokenizer.chat_template or "")
        parse_tool_calls("", tool_format)  # an unknown format fails here, not per request
        self.tokenizer, self.max_len, self.seed = tokenizer, max_len, seed
        self.tool_format = tool_format
        self._eos = frozenset(tokenizer.eos_ids)
        # A request without max_tokens may use all the room left in the episode.
        engine = EngineConfig(slots=slots, chunk=16, prefill_bucket=64)
        self._config = ServeConfig(MODEL_NAME, "episodes", engine, default_max_tokens=max_len)
        self._episodes: dict[str, _Live] = {}
        self._lock = threading.Lock()  # the episodes and their busy flags
        self._opened = 0
        self._backend = ServeBackend(model, tokenizer, self._config, max_len=max_len)
        try:
            sock = socket.create_server((host, port))
        except OSError:
            self._backend.close()
            raise
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(_app(self), log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="posttrain-episodes",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the episode server did not start on {self.url}")
            time.sleep(0.01)

    def open_episode(self, record: dict | None = None) -> str:
        """Opens an episode; returns its id (`base_url(id)` is the agent's base URL).

        Args:
          record: what the episode is about (the prompt record a reward is computed from);
            kept as `Episode.record`.
        """
        episode_id = uuid.uuid4().hex
        with self._lock:
            self._opened += 1
            episode = Episode(record=dict(record or {}), prompt_ids=[])
            self._episodes[episode_id] = _Live(episode, serial=self._opened)
        return episode_id

    def base_url(self, episode_id: str) -> str:
        """The OpenAI base URL of an episode: `OpenAI(base_url=server.base_url(id))`."""
        return f"{self.url}/episodes/{episode_id}/v1"

    def close_episode(self, episode_id: str, reward: float | None = None) -> Episode:
        """Closes an episode; returns what it recorded.

        Args:
          episode_id: an id from `open_episode`.
          reward: the episode's reward (`Episode.reward`); None to score it later.

        Returns:
          The episode: finish_reason "stop", or "length" when its last reply reached its
          max_tokens (truncated). An episode whose agent never called has no turns and no ids.

        Raises:
          KeyError: no open episode has this id.
          RuntimeError: a request of the episode is in progress.
        """
        with self._lock:
            live = self._episodes.get(episode_id)
            if live is None:
                raise KeyError(f"no open episode {episode_id!r} (closed, or never opened)")
            if live.busy:
                raise RuntimeError(f"episode {episode_id!r} has a request in progress; close it "
                                   "after the agent's last reply")  # fmt: skip
            del self._episodes[episode_id]
        episode = live.episode
        episode.reward, episode.finish_reason = reward, "length" if live.cut else "stop"
        return episode

    def stop(self) -> None:
        """Stops serving (requests in progress fail) and the engine thread."""
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._backend.close()

    def __enter__(self) -> "EpisodeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _claim(self, episode_id: str) -> _Live:
        """The episode, marked busy; 404 when it is not open, 409 when it is busy."""
        with self._lock:
            live = self._episodes.get(episode_id)
            if live is None:
                raise APIError(f"no open episode {episode_id!r} on this server (closed, or "
                                "never opened)", status=404, kind="not_found_error")  # fmt: skip
            if live.busy:
                raise APIError(f"episode {episode_id!r} has a request in progress; an episode's "
                                "turns are sequential: send the next request after its reply",
                                status=409, kind="conflict_error")  # fmt: skip
            live.busy = True
            return live

    def _release(self, live: _Live) -> None:
        with self._lock:
            live.busy = False

    def _check(self, live: _Live, body: dict) -> _Turn:
        """What the request adds to the episode; 400 when it does not extend its conversation."""
        sent = body.get("messages")
        if not isinstance(sent, list) or not sent:
            raise APIError("'messages' must be a non-empty list of messages", param="messages")
        messages = [_message(m, i) for i, m in enumerate(sent)]
        tools = request_tools(body)
        canonical = json.dumps(tools, sort_keys=True)
        try:
            if live.turns is None:
                turns = Turns(self.tokenizer, tools)
                return _Turn(messages, turns.prompt(messages), turns, canonical)
            if canonical != live.tools:
                raise APIError("the request's tools differ from the episode's first request's "
                                "(its prompt has them); send the same tools on every turn",
                                param="tools")  # fmt: skip
            recorded = live.episode.messages
            for i, (old, new) in enumerate(zip(recorded, messages, strict=False)):
                if old != new:
                    why = f"message {i} is {json.dumps(new):.120} instead of {json.dumps(old):.120}"
                    raise APIError(_rewritten(why), param="messages")
            if len(messages) <= len(recorded):
                raise APIError(_rewritten(
                    f"it has {len(messages)} messages and adds none after the {len(recorded)} "
                    "recorded"), param="messages")  # fmt: skip
            added = messages[len(recorded) :]
            ids = live.turns.observation(recorded, added, ended=live.ended)
            return _Turn(added, ids, live.turns, live.tools)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(f"cannot render the messages with the chat template: {e}") from None

    def _record(self, live: _Live, turn: _Turn, completion: Completion) -> dict:
        """Appends the turn and the model's reply to the episode; returns the reply message."""
        episode = live.episode
        if live.turns is None:
            live.turns, live.tools = turn.turns, turn.tools
            episode.prompt_ids = list(turn.ids)
        else:
            episode.token_ids += turn.ids
            episode.logprobs += [0.0] * len(turn.ids)
            episode.mask += [0] * len(turn.ids)
        episode.messages += turn.messages
        tokens = list(completion.token_ids)
        episode.token_ids += tokens
        episode.logprobs += list(completion.logprobs)
        episode.mask += [1] * len(tokens)
        live.ended = bool(tokens) and tokens[-1] in self._eos
        live.cut = completion.finish_reason == "length"
        body = tokens[:-1] if live.ended else tokens
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        tools = live.turns.tools
        parsed = parse_tool_calls(text, self.tool_format) if tools else ParsedTurn(text, [], [])
        message = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        episode.messages.append(message)
        episode.text = parsed.content
        episode.turns += 1
        episode.tool_calls += len(parsed.tool_calls) + len(parsed.errors)
        episode.tool_errors += len(parsed.errors)
        return message

    def _seed(self, live: _Live) -> int:
        """The default seed of an episode's next turn: from the server's seed, the episode's
        number and the turn's."""
        entropy = [self.seed % 2**32, live.serial, live.episode.turns]
        return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def _rewritten(why: str) -> str:
    """The 400 message of a request that does not extend the recorded conversation."""
    return (
        f"the request does not extend the episode's recorded conversation: {why}. The episode "
        "records the tokens the model sampled (token in / token out), so its history cannot be "
        "rewritten: send the recorded messages unchanged (each reply as it was returned) and "
        "append the new ones, or open a new episode"
    )


def _message(m, i: int) -> dict:
    """Message `i` as the template renders it and the episode records it: text content ("" for
    none), tool calls with ids and arguments as objects; other fields dropped."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise APIError(f"message {i} must be an object with a 'role'", param="messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise APIError(f"message {i}: only text content parts are supported", param="messages")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise APIError(f"message {i}'s content must be text", param="messages")
    out = {"role": m["role"], "content": content or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [_call(c, i) for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _call(call, i: int) -> dict:
    """A tool call of message `i`, its arguments as an object (OpenAI sends a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(f"message {i} has a tool call without a function name", param="messages")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            message = f"message {i}: tool call arguments {arguments[:60]!r} are not JSON"
            raise APIError(message, param="messages") from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if call.get("id") is not None else out


def _reply(message: dict, completion: Completion, prompt_tokens: int) -> dict:
    """The chat.completion response of a recorded reply (tool-call arguments as JSON strings)."""
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in message.get("tool_calls", [])
    ]
    out = {"role": "assistant", "content": message["content"] or None}
    if calls:
        out["tool_calls"] = calls
    used = len(completion.token_ids)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": MODEL_NAME,
        "choices": [{"index": 0, "message": out, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else completion.finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used,
                  "total_tokens": prompt_tokens + used},
    }  # fmt: skip


def _app(server: EpisodeServer):
    """The app: `POST /episodes/{episode_id}/v1/chat/completions`."""
    import fastapi

    app = api_app("posttrain episodes")
    backend = server._backend

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat_completions(episode_id: str, request: fastapi.Request):
        try:
            body = await request.json()
        except ValueError:
            raise APIError("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        live = server._claim(episode_id)
        try:
            if request_field(body, "stream", bool, False):
                raise APIError("episodes are answered whole: send stream=false", param="stream")
            if request_field(body, "n", int, 1) != 1:
                raise APIError("an episode is one conversation: n must be 1", param="n")
            turn = server._check(live, body)
            episode = live.episode
            prompt = [*episode.prompt_ids, *episode.token_ids, *turn.ids]  # [] [] on turn 1
            seed = server._seed(live) if body.get("seed") is None else body["seed"]
            seeded = {**body, "seed": seed}
            settings = request_settings(seeded, [prompt], server.max_len, server._config)
            [[completion]] = await backend.complete([prompt], settings)
            message = server._record(live, turn, completion)
            return _reply(message, completion, len(prompt))
        finally:
            server._release(live)

    return app
