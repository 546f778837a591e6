"""Environments: one per episode, made from a prompt record; tools; the registry of both.

An environment answers the model's turns: `reset()` gives the opening messages, and
`step(message)` takes the model's turn (its text and the tool calls parsed from it) and
returns `Step(observations, reward, done, info)`. Tools are Python callables whose JSON schema
comes from their type hints and docstring (`posttrain.data.tool_schema`); the rollout renders
those schemas into the prompt with the model's chat template and parses calls back from its
own format.

`ToolEnvironment` is the common case: run the calls, answer each with a `tool` message (an
exception, an unknown tool, bad arguments or a malformed call become an error message the model
can recover from), and end the episode at the first turn without calls, whose text is the
answer (`reward=None`: the record's reward domain scores it, as in single-turn RL).

Environments are registered by name (`register_env`), so a config selects one
(`env.name`), like a reward domain.
"""

from __future__ import annotations

import inspect
import json
import secrets
import string
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from posttrain.data import tool_schema
from posttrain.parallel import tracing


class Step(NamedTuple):
    """What an environment answers to one of the model's turns.

    observations: messages that follow the turn (role "tool" or "user"); empty when done.
    reward: the episode's reward when `done` (None: score the last turn's text with the
      record's reward domain); per-turn rewards go in `info["turn_reward"]`.
    done: the episode is over.
    info: counts for metrics: "tool_calls", "tool_errors", "tool_s", "turn_reward".
    """

    observations: list[dict]
    reward: float | None = None
    done: bool = False
    info: dict = {}


class Tool:
    """A callable the model may call: `fn(**arguments) -> result` (made a string for the
    model), described by `schema` (default: from `fn`'s type hints and docstring)."""

    def __init__(self, fn: Callable, *, name: str | None = None, schema: dict | None = None):
        self.fn = fn
        self.schema = schema or tool_schema(fn)
        if name is not None:
            self.schema = {**self.schema, "function": {**self.schema["function"], "name": name}}
        self.name = self.schema["function"]["name"]

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        out = self.fn(**arguments)
        return out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)

    def __repr__(self):
        return f"Tool({self.name!r})"


class Environment:
    """One episode. Subclasses set `tools` and implement `reset` and `step`; `close` frees
    what the episode held (a workspace, processes) and runs whatever happened."""

    tools: Sequence[Tool] = ()

    def __init__(self, record: Mapping[str, Any]):
        self.record = record

    def reset(self) -> list[dict]:
        raise NotImplementedError

    def step(self, message: dict) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        pass

    @property
    def schemas(self) -> list[dict] | None:
        return [t.schema for t in self.tools] or None


def prompt_messages(record: Mapping[str, Any], system: str = "") -> list[dict]:
    """A record's opening messages: its "prompt" (text, or a list of messages), after the
    environment's system message when it has one and the prompt does not."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(
            f"an episode's record needs a 'prompt' (text or messages), got {prompt!r:.80}"
        )
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


class ToolEnvironment(Environment):
    """The model calls tools until it answers: each turn's calls run in order and each gets a
    `tool` message with its result or error; a turn without calls ends the episode, and the
    reward domain scores its text (`reward=None`).

    Args:
      record: the prompt record.
      tools: the tools offered.
      system: a system message put before the prompt (e.g. how to use the tools).
    """

    def __init__(self, record: Mapping[str, Any], tools: Sequence[Tool], system: str = ""):
        super().__init__(record)
        self.tools = tuple(tools)
        self.system = system
        self._by_name = {t.name: t for t in self.tools}

    def reset(self) -> list[dict]:
        return prompt_messages(self.record, self.system)

    def step(self, message: dict) -> Step:
        calls = message.get("tool_calls") or []
        errors = message.get("tool_call_errors") or []
        if not calls and not errors:
            return Step([], None, True, {"tool_calls": 0, "tool_errors": 0, "tool_s": 0.0})
        observations, failed, start = [], 0, time.perf_counter()
        for error in errors:
            observations.append(tool_message(f"Error: {error}", None))
            failed += 1
        for call in calls:
            started = tracing.now_ns()
            content, ok = self.call(call)
            tracing.record("tool_call", started, tracing.now_ns(), tool=call["function"]["name"],
                           ok=ok)  # fmt: skip
            observations.append(tool_message(content, call))
            failed += not ok
        info = {
            "tool_calls": len(calls) + len(errors),
            "tool_errors": failed,
            "tool_s": time.perf_counter() - start,
        }
        return Step(observations, None, False, info)

    def call(self, call: Mapping[str, Any]) -> tuple[str, bool]:
        """(the result or an error message for the model, whether the call succeeded)."""
        name = call["function"]["name"]
        arguments = call["function"].get("arguments") or {}
        tool = self._by_name.get(name)
        if tool is None:
            return (
                f"Error: there is no tool named {name!r}; the tools are {sorted(self._by_name)}",
                False,
            )
        if not isinstance(arguments, Mapping):
            return f"Error: the arguments of {name} must be a JSON object", False
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as e:
            return f"Error: bad arguments for {name}: {e}", False
        try:
            return tool(arguments), True
        except Exception as e:  # the tool failed: the model sees why and may try again
            return f"Error: {type(e).__name__}: {e}", False


def tool_message(content: str, call: Mapping[str, Any] | None) -> dict:
    """A `tool` message answering `call` (None: a call that could not be parsed)."""
    call_id = call.get("id") if call else None
    message = {"role": "tool", "content": content, "tool_call_id": call_id or _call_id()}
    if call:
        message["name"] = call["function"]["name"]
    return message


def _call_id() -> str:
    # Nine alphanumerics: the one id shape every template accepts (Mistral's requires it).
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


# -- the registry ---------------------------------------------------------------------------

EnvFactory = Callable[..., Environment]
_ENVS: dict[str, EnvFactory] = {}
_SELF_REWARDING: set[str] = set()
_TOOL_TIMED: set[str] = set()


def register_env(
    name: str, factory: EnvFactory, *, rewards: bool = False, tool_budget: bool = False
) -> None:
    """Makes `factory(record, **options) -> Environment` selectable as `env.name=name`.

    `rewards=True`: its episodes end with their own reward (e.g. hidden tests), so its records
    need no reward domain; otherwise the record's domain scores the final answer.
    `tool_budget=True`: the factory takes `max_tool_s`, the episode's tool seconds, and stops
    its own calls when they are spent (RL runs pass `env.max_tool_s`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"an environment name is a non-empty string, got {name!r}")
    _ENVS[name] = factory
    (_SELF_REWARDING.add if rewards else _SELF_REWARDING.discard)(name)
    (_TOOL_TIMED.add if tool_budget else _TOOL_TIMED.discard)(name)


def rewards_itself(name: str) -> bool:
    """Whether environment `name` gives its episodes' rewards (no reward domain needed)."""
    return name in _SELF_REWARDING


def takes_tool_budget(name: str) -> bool:
    """Whether environment `name` takes the episode's `max_tool_s` and stops calls past it."""
    return name in _TOOL_TIMED


def env_names() -> list[str]:
    return sorted(_ENVS)


def make_env(name: str, record: Mapping[str, Any], **options: Any) -> Environment:
    """A new environment `name` for one episode of `record`."""
    if name not in _ENVS:
        raise ValueError(f"unknown environment {name!r}; registered: {env_names()}")
    return _ENVS[name](record, **options)
