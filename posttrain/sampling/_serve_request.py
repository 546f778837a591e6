"""What `posttrain serve` accepts: a request's fields checked into engine settings and token
ids, or refused as an `_APIError` (OpenAI's error body, HTTP 4xx) that says what to change."""

import json
import secrets

import jinja2

from posttrain.sampling._backend import ServeConfig, Settings
from posttrain.sampling._completion import _encode, check_settings
from posttrain.sampling._params import SamplingParams


class _APIError(Exception):
    """A refused request: HTTP `status` with OpenAI's error body."""

    def __init__(
        self, message: str, *, status=400, kind="invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


_KINDS = {int: "an integer", float: "a number", bool: "true or false", dict: "an object"}
# Accepted only at their neutral values (absent, null, false, 0, 1 for best_of, text format).
_UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias",
                "presence_penalty", "frequency_penalty", "response_format")  # fmt: skip


def _get(body: dict, name: str, kind: type, default=None):
    """`body[name]` if it is of `kind` (float takes ints; only bool takes bools), else 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float) if kind is float else kind) or (
        isinstance(value, bool) and kind is not bool
    ):
        raise _APIError(
            f"{name!r} must be {_KINDS[kind]}, got {json.dumps(value)[:60]}", param=name
        )
    return value


def _settings(body: dict, prompts: list[list[int]], limit: int, config: ServeConfig) -> Settings:
    """The request's checked settings; 400 when one is out of range or a prompt is too long."""
    for name in _UNSUPPORTED:
        value = body.get(name)
        if value and value != {"type": "text"} and not (name == "best_of" and value == 1):
            raise _APIError(f"{name!r} is not supported by posttrain serve", param=name)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _APIError("'stop' must be a string or a list of non-empty strings", param="stop")
    requested = _get(body, "max_completion_tokens", int, _get(body, "max_tokens", int))
    if requested is not None and requested < 1:
        raise _APIError(f"max_tokens must be >= 1, got {requested}", param="max_tokens")
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    size = len(prompts[longest])
    max_tokens = requested or min(config.default_max_tokens, limit - size)
    if size + max(max_tokens, 1) > limit:
        which = "the prompt" if len(prompts) == 1 else f"prompt {longest}"
        raise _APIError(
            f"This model's maximum context length is {limit} tokens, but {which} has {size} "
            + (
                f"tokens and max_tokens is {max_tokens} ({size + max_tokens} in all); shorten "
                "the prompt or lower max_tokens"
                if requested
                else "tokens, which leaves no room for the completion; shorten the prompt"
            ),
            param="messages" if "messages" in body else "prompt",
        )
    temperature = float(_get(body, "temperature", float, 1.0))
    top_p, top_k = float(_get(body, "top_p", float, 1.0)), _get(body, "top_k", int, 0)
    n = _get(body, "n", int, 1)
    try:
        check_settings(
            max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n
        )
    except ValueError as e:
        raise _APIError(str(e)) from None
    settings = Settings(
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature, top_p, top_k),
        n=n,
        seed=_get(body, "seed", int, secrets.randbelow(2**31)) % 2**32,
        stop=tuple(stop),
    )
    if _get(body, "stream", bool, False) and (settings.n > 1 or len(prompts) > 1):
        raise _APIError("a streamed request takes one prompt and n=1", param="stream")
    return settings


def _prompt_ids(tokenizer, prompt) -> list[list[int]]:
    """The token ids of /v1/completions' `prompt`: a string, token ids, or a list of either."""
    ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
    prompts = [prompt] if isinstance(prompt, str) or ids else prompt
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(
            isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
            for p in prompts
        )
    ):
        raise _APIError(
            "'prompt' must be a string, a list of token ids, or a non-empty list of either",
            param="prompt",
        )
    try:
        ids = _encode(tokenizer, prompts)
    except ValueError as e:
        raise _APIError(str(e), param="prompt") from None
    if bad := [t for p in ids for t in p if not 0 <= t < tokenizer.vocab_size]:
        raise _APIError(
            f"token id {bad[0]} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
            param="prompt",
        )
    return ids


def _chat_ids(tokenizer, messages, tools) -> list[int]:
    """The chat template's rendering of `messages` (OpenAI's shape) with the generation prompt."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _APIError("'messages' must be a list of message objects", param="messages")
    rendered = []
    for m in messages:
        content = m.get("content")
        if not isinstance(m.get("role"), str):
            raise _APIError("each message needs a 'role' string", param="messages")
        if content is not None and not isinstance(content, (str, list)):
            raise _APIError(
                "a message's 'content' must be a string, a list of text parts or null, got "
                f"{json.dumps(content)[:60]}",
                param="messages",
            )
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise _APIError("only text content parts are supported", param="messages")
            m = {**m, "content": "".join(p.get("text", "") for p in m["content"])}
        rendered.append({"content": None, **m} if "tool_calls" in m else m)
    try:
        return tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tools=tools)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise _APIError(f"cannot render the messages with the chat template: {e}") from None


def _tools(body: dict) -> list[dict] | None:
    """The request's tools for the template; none with tool_choice "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise _APIError("'tools' must be a list of tool objects", param="tools")
    if choice not in ("auto", "none"):
        raise _APIError("only tool_choice 'auto' and 'none' are supported", param="tool_choice")
    return tools if tools and choice == "auto" else None
