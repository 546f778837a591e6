"""What `posttrain serve` answers: OpenAI's response objects for a request's completions,
whole or as streamed chunks, with `<tool_call>` blocks parsed into `tool_calls`."""

import json
import time
import uuid
from collections.abc import AsyncIterator

from posttrain.data import parse_tool_calls
from posttrain.sampling._backend import Piece, _first, _partial
from posttrain.sampling._completion import Completion

_OPEN = "<tool_call>"


def _tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text outside the blocks, OpenAI tool calls) of `text`'s
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, arguments as a JSON
    string as the API returns them; when any block is not such a call, the text stays text
    and there are no calls."""
    turn = parse_tool_calls(text, "hermes")
    if turn.errors or not turn.tool_calls:
        return text, []
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in turn.tool_calls
    ]
    return turn.content, calls


class _Reply:
    """The response of one request: whole (`whole`) or as chunks (`chunks`)."""

    def __init__(self, model: str, prompt_tokens: int, *, chat: bool, tools=None):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model, self.prompt_tokens, self.chat, self.tools = model, prompt_tokens, chat, tools
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict], usage: int | None = None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        out["choices"] = choices
        if usage is not None:
            out["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": usage,
                "total_tokens": self.prompt_tokens + usage,
            }
        return out

    def whole(self, results: list[list[Completion]]) -> dict:
        """The response of every prompt's completions, in order."""
        flat = [c for samples in results for c in samples]
        choices = []
        for index, c in enumerate(flat):
            if not self.chat:
                choices.append({"index": index, "text": c.text, "logprobs": None,
                                "finish_reason": c.finish_reason})  # fmt: skip
                continue
            content, calls = _tool_calls(c.text) if self.tools else (c.text, [])
            message = {"role": "assistant", "content": content if content.strip() else None}
            if calls:
                message["tool_calls"] = calls
            finish = "tool_calls" if calls else c.finish_reason
            choices.append({"index": index, "message": message, "logprobs": None,
                            "finish_reason": finish})  # fmt: skip
        kind = "chat.completion" if self.chat else "text_completion"
        return self._envelope(kind, choices, sum(len(c.token_ids) for c in flat))

    def _chunk(self, delta: dict | str, finish: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    async def chunks(
        self, pieces: AsyncIterator[Piece], include_usage: bool
    ) -> AsyncIterator[dict]:
        """The streamed response; with tools, text from the first `<tool_call>` on is held
        back and sent at the end as `tool_calls` (or as text, if it does not parse)."""
        if self.chat:
            yield self._chunk({"role": "assistant", "content": ""}, None)
        content = (lambda text: {"content": text}) if self.chat else (lambda text: text)
        held, last = "", None
        async for last in pieces:
            held += last.text
            cut = _first(held, [_OPEN]) if self.tools else -1
            ready = cut if cut >= 0 else len(held) - (_partial(held, [_OPEN]) if self.tools else 0)
            if ready:
                yield self._chunk(content(held[:ready]), None)
                held = held[ready:]
        text, calls = _tool_calls(held) if self.tools else (held, [])
        if text and (text.strip() or not calls):
            yield self._chunk(content(text), None)
        if calls:
            yield self._chunk(
                {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, None
            )
        yield self._chunk({} if self.chat else "", "tool_calls" if calls else last.finish_reason)
        if include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            yield self._envelope(kind, [], last.num_tokens)
